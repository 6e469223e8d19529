"""The sharded torch learner (FSDP2 over gloo, ranks as Ray actors) equals one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncrl.checkpoint import Checkpointer
from asyncrl.config import load_config
from asyncrl.learner import lora
from asyncrl.learner.torch.distributed import DistributedTorchLearner
from tests.test_critic import CRITIC
from tests.test_critic import _learner as _critic_learner
from tests.test_reference_worker import build_reference_model
from tests.test_torch_learner import _groups, _learner


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["actor.ppo_mini_batch_size=4", "actor.shuffle=true"],
        # batch-level advantages: each rank whitens over the whole batch, not its shard
        ["algorithm.adv_estimator=reinforce_plus_plus", "actor.ppo_mini_batch_size=4"],
    ],
)
def test_two_ranks_match_one_process(tiny_model, extra):
    _two_ranks_match_one_process(tiny_model, extra)


def test_two_ranks_with_a_reference_model_match_one_process(tiny_model, tmp_path):
    """Every rank loads the configured reference; the KL term trains them alike."""
    reference = build_reference_model(tiny_model, tmp_path / "reference")
    extra = ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.5", "reference.infer_batch_size=2",
             f"reference.model_args.model_name_or_path={reference}"]  # fmt: skip
    metrics = _two_ranks_match_one_process(tiny_model, extra)
    assert metrics["actor/kl_loss"] > 0.05


@pytest.mark.parametrize("ctrl", ["fixed", "adaptive"])
def test_two_ranks_with_kl_in_reward_match_one_process(tiny_model, tmp_path, ctrl):
    """Each rank scores its own rows against the reference; the penalised rewards, advantages
    and the controller's update come from the whole batch, the same on every rank."""
    reference = build_reference_model(tiny_model, tmp_path / "reference")
    extra = ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.use_kl_in_reward=true",
             "algorithm.kl_ctrl.kl_coef=0.5", f"algorithm.kl_ctrl.type={ctrl}",
             "algorithm.kl_ctrl.horizon=6", "actor.ppo_mini_batch_size=4",
             "reference.infer_batch_size=2", f"reference.model_args.model_name_or_path={reference}"]  # fmt: skip
    metrics = _two_ranks_match_one_process(tiny_model, extra)
    assert metrics["actor/reward_kl_penalty"] > 0.01


@pytest.mark.parametrize(
    "extra",
    [
        # 6 rows, mini-batches of 3, micro-batches of 1 row: in each mini-batch one rank has 2
        # rows and the other 1 (plus a zero-loss pass, for the matching collectives)
        ["actor.ppo_mini_batch_size=3", "actor_train.training_args.per_device_train_batch_size=1",
         "critic.training_args.per_device_train_batch_size=1", "critic.infer_batch_size=2",
         "algorithm.gamma=0.9", "algorithm.lam=0.8"],
        # packed value passes and updates under a token budget
        ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=40"],
    ],
)  # fmt: skip
def test_critic_with_gae_two_ranks_match_one_process(tiny_model, tmp_path, extra):
    """critic + gae: each rank scores its rows, the whole batch's values are gathered, every
    rank computes the same GAE; the critic trains on each rank's rows (FSDP reduces its
    gradients): losses, `critic/*` metrics and the critic's weights equal one process's."""
    metrics = _two_ranks_match_one_process(tiny_model, extra, critic=tmp_path)
    assert metrics["critic/vf_loss"] > 0.0


def test_critic_on_uneven_shards_two_ranks_match_one_process(tiny_model, tmp_path):
    """3 rows, one per value pass and micro-batch: rank 1 holds 1 row to rank 0's 2, so it
    runs a padding value forward and a zero-loss update pass (the collectives match)."""
    extra = ["critic.infer_batch_size=1", "critic.training_args.per_device_train_batch_size=1",
             "actor_train.training_args.per_device_train_batch_size=1"]  # fmt: skip
    _two_ranks_match_one_process(tiny_model, extra, critic=tmp_path, shape=(1, 3))


def test_critic_with_kl_in_reward_two_ranks_match_one_process(tiny_model, tmp_path):
    """gae over KL-penalised rewards: the whole batch's logprobs and values gathered on every
    rank (one path, `TorchLearner._sharded_advantages`)."""
    reference = build_reference_model(tiny_model, tmp_path / "reference")
    extra = ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.5",
             "reference.infer_batch_size=2", f"reference.model_args.model_name_or_path={reference}"]  # fmt: skip
    metrics = _two_ranks_match_one_process(tiny_model, extra, critic=tmp_path / "ckpt")
    assert metrics["actor/reward_kl_penalty"] > 0.01 and metrics["critic/vf_loss"] > 0.0


def _two_ranks_match_one_process(
    model_dir, extra: list[str], critic: Path | None = None, shape: tuple[int, int] = (2, 3)
) -> dict[str, float]:
    """Two steps of one process and of two FSDP2 ranks on the same batches: equal losses (and
    KL) and weights. `critic`: with the critic of tests/test_critic.py (gae), its `critic/*`
    metrics and weights compared too (read back through a sharded checkpoint written there).
    `shape`: (groups, responses per group) of each batch.
    Returns the two-rank learner's last metrics."""
    extra = [*CRITIC, *extra] if critic is not None else extra
    single = _learner(model_dir, *extra) if critic is None else _critic_learner(model_dir, *extra)
    # The one-process steps go first: a world-1 learner next to a live default process group
    # would still take part in the logprob passes' collectives.
    batches = [_groups(n_groups=shape[0], n=shape[1], seed=seed) for seed in (0, 1)]
    expected = [single.step(groups) for groups in batches]
    kwargs = {
        "model_path": model_dir, "train": single.train, "actor": single.actor,
        "algorithm": single.algorithm, "temperature": 0.7, "total_steps": 10,
        "reference": load_config(None, extra).reference, "critic": load_config(None, extra).critic,
    }  # fmt: skip
    dist = DistributedTorchLearner(2, **kwargs)
    try:
        for groups, m_single in zip(batches, expected, strict=True):
            m_dist = dist.step(groups)
            assert m_dist["learner/world_size"] == 2.0
            assert m_dist["actor/pg_loss"] == pytest.approx(m_single["actor/pg_loss"], abs=1e-5)
            for key in ("actor/kl_loss", "actor/reward_kl_penalty",
                        "actor/reward_kl_penalty_coeff", "learner/adv_mean"):  # fmt: skip
                if key in m_single:
                    assert m_dist[key] == pytest.approx(m_single[key], abs=1e-5), key
            critic_keys = [k for k in m_single if k.startswith("critic/")]
            assert bool(critic_keys) == (critic is not None)
            assert {k for k in m_dist if k.startswith("critic/")} == set(critic_keys)
            for key in critic_keys:
                assert m_dist[key] == pytest.approx(m_single[key], abs=1e-5, rel=1e-4), key
        ref = single.model.state_dict()
        gathered = dict(dist.weights_for_sync())  # full tensors, gathered from the shards
        assert gathered.keys() == ref.keys() - lora.tied_copies(single.model)  # no tied head
        for name, p in gathered.items():
            torch.testing.assert_close(p, ref[name], atol=1e-5, rtol=1e-4, msg=name)
        assert dist.version == 2
        if critic is not None:
            _assert_same_critic(dist, single, model_dir, extra, critic)
    finally:
        dist.close()
    return m_dist


def _assert_same_critic(dist, single, model_dir, extra: list[str], root: Path) -> None:
    """The critic's weights of the 2 ranks (a sharded checkpoint read into one process) equal
    the one-process critic's."""
    saved = Checkpointer(root, ["model", "optimizer"]).save(dist.version, dist, {})
    resumed = _critic_learner(model_dir, *extra)
    Checkpointer.open(saved).apply(resumed, {"model", "optimizer"})
    want = single.critic.model.state_dict()
    got = resumed.critic.model.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=1e-4, msg=name)

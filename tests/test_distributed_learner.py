"""The sharded torch learner (FSDP2 over gloo, ranks as Ray actors) equals one process."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.learner.torch.distributed import DistributedTorchLearner
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


def _two_ranks_match_one_process(model_dir, extra: list[str]) -> dict[str, float]:
    """Two steps of one process and of two FSDP2 ranks on the same batches: equal losses (and
    KL) and weights. Returns the two-rank learner's last metrics."""
    single = _learner(model_dir, *extra)
    # The one-process steps go first: a world-1 learner next to a live default process group
    # would still take part in the logprob passes' collectives.
    batches = [_groups(seed=seed) for seed in (0, 1)]
    expected = [single.step(groups) for groups in batches]
    kwargs = {
        "model_path": model_dir, "train": single.train, "actor": single.actor,
        "algorithm": single.algorithm, "temperature": 0.7, "total_steps": 10,
        "reference": load_config(None, extra).reference,
    }  # fmt: skip
    dist = DistributedTorchLearner(2, **kwargs)
    try:
        for groups, m_single in zip(batches, expected, strict=True):
            m_dist = dist.step(groups)
            assert m_dist["learner/world_size"] == 2.0
            assert m_dist["actor/pg_loss"] == pytest.approx(m_single["actor/pg_loss"], abs=1e-5)
            if "actor/kl_loss" in m_single:
                assert m_dist["actor/kl_loss"] == pytest.approx(m_single["actor/kl_loss"], abs=1e-5)
        ref = single.model.state_dict()
        gathered = dict(dist.weights_for_sync())  # full tensors, gathered from the shards
        assert gathered.keys() == ref.keys()
        for name, p in gathered.items():
            torch.testing.assert_close(p, ref[name], atol=1e-5, rtol=1e-4, msg=name)
        assert dist.version == 2
    finally:
        dist.close()
    return m_dist

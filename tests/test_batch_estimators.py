"""Batch-level advantage estimators in the learner (REINFORCE++ and its baseline variant).

The learner computes them once per rollout batch, on the whole collated batch and before any
row is sharded over ranks or mini-batches, through `asyncrl.algo.advantages` (the same code for
single-turn responses and env episodes); gae is refused for want of a critic. The model is the
tiny random one from conftest; nothing else is faked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.algo.advantages import AdvantageParams, batch_outcome_advantages
from asyncrl.config import load_config
from asyncrl.config.schema import AlgorithmConfig
from asyncrl.learner.collate import collate
from asyncrl.learner.logprobs import token_logprobs
from asyncrl.learner.objective import advantage_metrics, batch_advantages, check_estimator
from asyncrl.learner.torch.learner import TorchLearner
from asyncrl.types import TrajectoryGroup

RFPP, RFPPB = "reinforce_plus_plus", "reinforce_plus_plus_baseline"


def _group(gid: str, rewards: list[float], seed: int, masks=None, advantages=None):
    """One group of len(rewards) responses; `masks[i]` a loss mask (0: environment tokens)."""
    rng = np.random.default_rng(seed)
    responses = []
    for i, reward in enumerate(rewards):
        mask = None if masks is None else np.asarray(masks[i], np.uint8)
        length = len(mask) if mask is not None else int(rng.integers(2, 6))
        response = {
            "response_ids": rng.integers(5, 40, length),
            "rollout_logprobs": -rng.random(length) * 3,
            "versions": np.where(mask == 0, -1, 0) if mask is not None else np.zeros(length),
            "reward": reward,
            "finish_reason": "stop",
        }
        if mask is not None:
            response["loss_mask"] = mask
        if advantages is not None:
            response["advantages"] = advantages[i]
        responses.append(response)
    return TrajectoryGroup.from_responses(gid, rng.integers(5, 40, 3), responses)


def _groups(seed: int = 0) -> list[TrajectoryGroup]:
    return [_group("a", [1.0, 0.0, 1.0], seed), _group("b", [0.0, 0.5, 2.0], seed + 1)]


def _data(groups: list[TrajectoryGroup], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The batch as the learner collates it (canonical group order)."""
    data = collate(sorted(groups, key=lambda g: g.group_id), pad_id).to_torch()
    data["response_mask"] = data["response_mask"].float()
    return data


def _learner(model_dir, *overrides: str) -> TorchLearner:
    cfg = load_config(
        None,
        [
            "actor_train.training_args.learning_rate=1e-3",
            "actor_train.model_args.disable_gradient_checkpointing=true",
            *overrides,
        ],
    )
    return TorchLearner(
        model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, temperature=0.7, total_steps=10
    )


# ------------------------------------------------------------------ the shared learner path


def test_group_estimators_keep_the_advantages_the_rollout_sent():
    carried = [np.full(2, 0.7), np.full(3, -0.7)]
    data = _data([_group("a", [1.0, 0.0], 0, [[1, 1], [1, 1, 1]], carried)])
    for name in ("grpo", "drgrpo", "rloo"):
        out = batch_advantages(AlgorithmConfig(adv_estimator=name), data)
        assert out is data["advantages"]


@pytest.mark.parametrize("name", [RFPP, RFPPB])
def test_batch_estimators_come_from_rewards_and_groups_of_the_collated_batch(name):
    groups = _groups()
    data = _data(groups)
    alg = AlgorithmConfig(adv_estimator=name, gamma=0.9)
    got = batch_advantages(alg, data)
    want = batch_outcome_advantages(
        name,
        torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 2.0], dtype=torch.float64),
        data["response_mask"],
        [0, 0, 0, 1, 1, 1],
        AdvantageParams(gamma=0.9),
    )
    assert got.dtype == torch.float32 and got.shape == data["response_mask"].shape
    torch.testing.assert_close(got, want.float())
    valid = got[data["response_mask"] > 0].double()
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.std().item() == pytest.approx(1.0, rel=1e-5)
    metrics = advantage_metrics(got, data["response_mask"])
    assert metrics["learner/adv_max"] > 0 > metrics["learner/adv_min"]


def test_baseline_groups_follow_the_trajectory_groups():
    # Same rewards in both groups: the group mean removes everything, whatever the batch holds.
    data = _data(
        [_group("a", [1.0, 3.0], 0, [[1, 1], [1]]), _group("b", [1.0, 3.0], 1, [[1], [1]])]
    )
    got = batch_advantages(AlgorithmConfig(adv_estimator=RFPPB), data)
    # centred scores -1, +1 per group; tokens: a0 (-1, -1), a1 (+1), b0 (-1), b1 (+1)
    values = np.array([-1.0, -1.0, 1.0, -1.0, 1.0])
    whitened = (values - values.mean()) / np.sqrt(values.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(got[data["response_mask"] > 0].numpy(), whitened, rtol=1e-6)


def test_carried_advantages_are_replaced_for_a_batch_estimator():
    carried = [np.full(2, 9.0), np.full(2, 9.0)]
    data = _data([_group("a", [1.0, 0.0], 0, [[1, 1], [1, 1]], carried)])
    got = batch_advantages(AlgorithmConfig(adv_estimator=RFPP), data)
    # returns 1, 1, 0, 0: mean 0.5, unbiased variance 1/3
    half = 0.5 / np.sqrt(1 / 3 + 1e-8)
    np.testing.assert_allclose(got.numpy(), [[half, half], [-half, -half]], rtol=1e-6)


def test_episodes_observation_tokens_and_failed_episodes():
    # Episode 0: turn, observation (mask 0), turn; episode 1 fails (all masked); episode 2 one
    # turn. Returns 1.0, 0.0 (failed), 0.0: the failed one stays out of the group mean (0.5).
    masks = [[1, 1, 0, 0, 1], [0, 0, 0], [1, 1]]
    data = _data([_group("env", [1.0, 0.0, 0.0], 0, masks)])
    mask = data["response_mask"] > 0
    base = batch_advantages(AlgorithmConfig(adv_estimator=RFPPB), data)
    assert (base[1] == 0).all() and (base[~mask] == 0).all()
    # centred +0.5 on the three generated tokens of episode 0, -0.5 on episode 2's two
    assert base[0, 0].item() == base[0, 4].item() > 0 > base[2, 0].item() == base[2, 1].item()
    rfpp = batch_advantages(AlgorithmConfig(adv_estimator=RFPP, gamma=0.5), data)
    # returns of episode 0: 0.25, 0.5 (across the observation), 1.0; episode 2: 0, 0
    returns = np.array([0.25, 0.5, 1.0, 0.0, 0.0])
    whitened = (returns - returns.mean()) / np.sqrt(returns.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(rfpp[mask].numpy(), whitened, rtol=1e-5, atol=1e-6)


def test_gae_is_refused_without_a_critic(tiny_model):
    alg = AlgorithmConfig(adv_estimator="gae")
    with pytest.raises(ValueError, match="gae needs a critic"):
        check_estimator(alg)
    with pytest.raises(ValueError, match="gae needs a critic"):
        batch_advantages(alg, _data(_groups()))
    with pytest.raises(ValueError, match="gae needs a critic"):
        _learner(tiny_model, "algorithm.adv_estimator=gae")


# ------------------------------------------------------------------ end to end, torch learner


def test_reinforce_plus_plus_step_trains_on_nonzero_advantages(tiny_model):
    learner = _learner(
        tiny_model, f"algorithm.adv_estimator={RFPP}", "algorithm.correction_mode=bypass",
        "actor.ppo_epochs=4",
    )  # fmt: skip
    groups = _groups()  # no advantages on the wire: collation would give zeros
    data = _data(groups, learner.pad_id)
    assert (data["advantages"] == 0).all()
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    logp_before, _ = token_logprobs(learner.model, data, 0.7)
    metrics = learner.step(groups)
    logp_after, _ = token_logprobs(learner.model, data, 0.7)
    assert metrics["learner/adv_max"] > 0 > metrics["learner/adv_min"]
    assert metrics["learner/adv_mean"] == pytest.approx(0.0, abs=1e-6)
    assert any(not torch.equal(p, before[n]) for n, p in learner.model.named_parameters())
    adv = batch_advantages(learner.algorithm, data)
    mask = data["response_mask"] > 0
    delta = (logp_after - logp_before).detach()[mask]
    # the policy-gradient surrogate sum(A * logp) went up, and tokens with positive advantage
    # gained more log-probability than those with negative advantage
    assert (adv[mask] * delta).sum() > 0
    assert delta[adv[mask] > 0].mean() > delta[adv[mask] < 0].mean()


@pytest.mark.parametrize("name", [RFPP, RFPPB])
def test_every_mini_batch_sees_the_batch_level_whitening(tiny_model, name):
    """The batch estimator, computed in the learner, trains exactly as if the rollout had sent
    the batch-level advantages with a group estimator: shuffled mini-batches of 2 rows never
    re-whiten their own rows."""
    mini = ["actor.ppo_mini_batch_size=2", "actor.shuffle=true", "actor.ppo_epochs=2"]
    groups = _groups()
    learner = _learner(tiny_model, f"algorithm.adv_estimator={name}", *mini)
    adv = batch_advantages(learner.algorithm, _data(groups))
    carried = []
    for gi, g in enumerate(sorted(groups, key=lambda x: x.group_id)):
        rows = [adv[gi * 3 + i, : g.response_lengths[i]].numpy() for i in range(g.n)]
        masks = [g.response(i, "loss_mask") for i in range(g.n)]
        carried.append(TrajectoryGroup.from_responses(
            g.group_id, g.prompt_ids,
            [{**r, "reward": g.rewards[i], "finish_reason": "stop", "advantages": rows[i],
              "loss_mask": masks[i]} for i, r in enumerate(g.iter_responses())],
        ))  # fmt: skip
    reference = _learner(tiny_model, "algorithm.adv_estimator=grpo", *mini)
    m_batch, m_ref = learner.step(groups), reference.step(carried)
    assert m_batch["actor/pg_loss"] == pytest.approx(m_ref["actor/pg_loss"], rel=1e-6, abs=1e-8)
    ref = dict(reference.model.named_parameters())
    for n, p in learner.model.named_parameters():
        torch.testing.assert_close(p, ref[n], msg=n)

"""Collapse is visible: the response-length distribution of a trained batch, the watch that
warns when entropy or lengths collapse or learning stalls, and the entropy the learner reports
on every step (whatever actor.entropy_coeff is)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.config import load_config
from asyncrl.learner.objective import objective
from asyncrl.metrics.collapse import LENGTH_KEYS, CollapseWatch, length_metrics
from asyncrl.types import TrajectoryGroup


def _group(lengths: list[int], key: str = "g") -> TrajectoryGroup:
    responses = [
        {
            "response_ids": np.full(n, 7),
            "rollout_logprobs": np.zeros(n),
            "versions": np.zeros(n, dtype=np.int64),
            "reward": 0.0,
            "finish_reason": "stop",
        }
        for n in lengths
    ]
    return TrajectoryGroup.from_responses(key, np.array([5, 6]), responses)


def test_length_metrics_are_percentiles_over_the_whole_batch():
    groups = [_group([1, 2, 3, 4, 5], "a"), _group([6, 7, 8, 9, 10], "b")]
    out = length_metrics(groups)
    expected = np.percentile(np.arange(1, 11), [10, 50, 90])
    assert [out[k] for k in LENGTH_KEYS.values()] == pytest.approx(expected.tolist())
    assert length_metrics([]) == {}


def _step(entropy=None, length=None, adv=None) -> dict[str, float]:
    m: dict[str, float] = {}
    if entropy is not None:
        m["actor/entropy"] = entropy
    if length is not None:
        lo, mid, hi = length
        m.update(dict(zip(LENGTH_KEYS.values(), (lo, mid, hi), strict=True)))
    if adv is not None:
        m["learner/adv_max"], m["learner/adv_min"] = adv
    return m


def test_entropy_collapse_warns_once_after_patience_and_rearms():
    watch = CollapseWatch(entropy_fraction=0.1, patience=3, baseline_steps=2)
    assert [watch.update(_step(entropy=1.0)) for _ in range(2)] == [None, None]
    assert watch.entropy_start == pytest.approx(1.0)
    assert watch.update(_step(entropy=0.05)) is None
    assert watch.update(_step(entropy=0.05)) is None
    line = watch.update(_step(entropy=0.05))
    assert line is not None and "entropy" in line and "learning_rate" in line
    assert "entropy_coeff" in line and "\n" not in line
    assert watch.update(_step(entropy=0.05)) is None  # once per collapse
    assert watch.update(_step(entropy=0.5)) is None  # recovered: re-armed
    assert [watch.update(_step(entropy=0.01)) for _ in range(3)][-1] is not None


def test_entropy_dips_shorter_than_patience_do_not_warn():
    watch = CollapseWatch(patience=3, baseline_steps=1)
    watch.update(_step(entropy=2.0))
    seen = [watch.update(_step(entropy=e)) for e in (0.1, 0.1, 1.5, 0.1, 0.1, 1.5)]
    assert seen == [None] * 6


def test_length_collapse_to_one_value_warns_and_names_causes():
    watch = CollapseWatch(patience=4)
    for _ in range(3):
        assert watch.update(_step(length=(10, 10, 10))) is None
    line = watch.update(_step(length=(10, 10, 10)))
    assert line is not None and "10 tokens" in line and "invalid" in line


def test_varied_or_drifting_lengths_do_not_warn():
    watch = CollapseWatch(patience=2)
    assert watch.update(_step(length=(8, 12, 20))) is None
    assert watch.update(_step(length=(8, 12, 20))) is None
    # one value per step, but a different one each step: not a fixed answer
    assert [watch.update(_step(length=(n, n, n))) for n in (5, 6, 7)] == [None] * 3


def test_steps_without_learning_signal_warn():
    watch = CollapseWatch(patience=2)
    assert watch.update(_step(adv=(0.0, 0.0))) is None
    line = watch.update(_step(adv=(0.0, 0.0)))
    assert line is not None and "advantage" in line
    assert CollapseWatch(patience=1).update(_step(adv=(1.2, -0.4))) is None


def test_missing_or_non_finite_metrics_are_ignored():
    watch = CollapseWatch(patience=1, baseline_steps=1)
    assert watch.update({}) is None
    assert watch.update({"actor/entropy": float("nan"), "learner/adv_max": "x"}) is None
    assert watch.entropy_start is None


@pytest.mark.parametrize("kwargs", [{"entropy_fraction": 0.0}, {"patience": 0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="CollapseWatch"):
        CollapseWatch(**kwargs)


def _objective_inputs():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[..., 0]
    ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    mask = torch.ones(2, 3)
    batch = {"old": logp.detach(), "advantages": torch.ones(2, 3), "mask": mask,
             "weights": None, "rollout_logprobs": logp.detach(), "ref": None}  # fmt: skip
    return logits, logp, ent, batch


def _loss_fn(logp, old, adv, mask, agg, params, weights, **_):
    return -(logp * adv * mask).sum() / mask.sum(), {}


@pytest.mark.parametrize("coeff", [0.0, 0.1])
def test_objective_reports_entropy_whatever_the_coefficient(coeff):
    cfg = load_config(None, [f"actor.entropy_coeff={coeff}"])
    logits, logp, ent, batch = _objective_inputs()
    h, pg = float(ent.detach().mean()), -float(logp.detach().mean())
    loss, metrics = objective(cfg.actor, _loss_fn, None, logp, ent.detach(), batch)
    assert metrics["actor/entropy"] == pytest.approx(h)
    # the bonus is in the loss exactly when the coefficient is non-zero
    assert float(loss.detach()) == pytest.approx(pg - coeff * h)
    full, _ = objective(cfg.actor, _loss_fn, None, logp, ent, batch)
    (grad,) = torch.autograd.grad(full, logits, retain_graph=True)
    (pg_grad,) = torch.autograd.grad(-logp.mean(), logits)
    assert torch.allclose(grad, pg_grad) == (coeff == 0.0)


def test_torch_learner_logs_entropy_with_coefficient_zero(tiny_model):
    from asyncrl.learner.torch.learner import TorchLearner

    cfg = load_config(None, ["actor.entropy_coeff=0.0"])
    learner = TorchLearner(tiny_model, cfg.actor_train, cfg.actor, cfg.algorithm,
                           temperature=1.0, total_steps=2)  # fmt: skip
    rng = np.random.default_rng(0)
    responses = [
        {"response_ids": rng.integers(5, 40, 4), "rollout_logprobs": -rng.random(4),
         "versions": np.zeros(4, dtype=np.int64), "reward": float(i % 2),
         "finish_reason": "stop", "advantages": np.full(4, 1.0 if i % 2 else -1.0)}
        for i in range(4)
    ]  # fmt: skip
    metrics = learner.step([TrajectoryGroup.from_responses("g", np.array([5, 6]), responses)])
    assert metrics["actor/entropy"] > 0.0

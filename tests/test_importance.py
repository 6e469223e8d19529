"""Rollout importance sampling, mismatch metrics, rejection sampling (asyncrl.algo)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algo.importance import (
    RolloutIS,
    apply_rollout_is,
    compute_rollout_importance_weights,
    normalize_weights_to_batch_mean,
    select_old_log_prob,
)
from asyncrl.algo.mismatch_metrics import quantiles
from asyncrl.algo.rejection import RejectionCriterion, rejection_mask

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "clip")
PAD = 50.0  # a log ratio under mask 0: it would dominate every result if it leaked in
SEED_METRICS = {
    "rollout_is_eff_sample_size",
    "rollout_is_mean",
    "rollout_is_std",
    "rollout_is_p25",
    "rollout_is_p50",
    "rollout_is_p75",
    "rollout_is_p95",
    "rollout_is_p99",
    "rollout_is_max",
    "rollout_is_min",
    "rollout_is_veto_fraction",
    "rollout_is_catastrophic_token_fraction",
    "rollout_is_clipped_fraction",
    "rollout_is_truncated_fraction",
    "rollout_is_ratio_fraction_high",
    "rollout_is_ratio_fraction_low",
    "rollout_is_seq_mean",
    "rollout_is_seq_std",
    "rollout_is_seq_max",
    "rollout_is_seq_min",
    "rollout_is_seq_max_deviation",
    "rollout_is_seq_fraction_high",
    "rollout_is_seq_fraction_low",
    "mismatch_kl",
    "mismatch_k3_kl",
    "mismatch_training_ppl",
    "mismatch_training_log_ppl",
    "mismatch_rollout_ppl",
    "mismatch_rollout_log_ppl",
    "mismatch_ppl_ratio",
    "mismatch_log_ppl_diff",
    "mismatch_log_ppl_abs_diff",
    "mismatch_log_ppl_diff_max",
    "mismatch_log_ppl_diff_min",
}

# Four sequences: in-bounds, above upper (2.0), one catastrophic token (-10 < log 1e-4),
# below lower (0.5). Padding holds PAD.
LR = [
    [0.3, -0.2, 0.1, 0.0],
    [1.2, 0.4, PAD, PAD],
    [-0.1, -10.0, 0.2, PAD],
    [-1.0, -0.5, -0.9, -0.8],
]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def _tensors(lr, mask, rollout_value: float = -1.0):
    """(old, rollout, mask) with old - rollout == lr."""
    lr_t = torch.tensor(lr, dtype=torch.float64)
    rollout = torch.full_like(lr_t, rollout_value)
    return (rollout + lr_t).float(), rollout.float(), torch.tensor(mask, dtype=torch.float32)


def _reference_weights(lr, mask, level, mode, upper, lower, veto):
    """The seed's weights in plain python, one sequence at a time."""
    out = []
    for lr_row, m_row in zip(lr, mask):
        valid = [x for x, m in zip(lr_row, m_row) if m]
        if level == "token":
            logs = list(lr_row)
        else:
            agg = sum(valid) if level == "sequence" else sum(valid) / max(len(valid), 1)
            logs = [agg] * len(lr_row)
        w = [math.exp(max(-20.0, min(20.0, x))) for x in logs]
        if mode == "truncate":
            w = [min(x, upper) for x in w]
        else:
            w = [x if lower <= x <= upper else 0.0 for x in w]
        if veto is not None and any(x < math.log(veto) for x in valid):
            w = [0.0] * len(w)
        out.append([x if m else 0.0 for x, m in zip(w, m_row)])
    return torch.tensor(out)


def _is(*args, **settings):
    """compute_rollout_importance_weights with a RolloutIS built from `settings` (threshold 2)."""
    settings.setdefault("threshold", 2.0)
    return compute_rollout_importance_weights(*args, RolloutIS(**settings))


@pytest.mark.parametrize("veto", [None, 1e-4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", LEVELS)
def test_weights_match_reference_for_every_level_mode_veto(level, mode, veto):
    weights, metrics = _is(
        *_tensors(LR, MASK),
        level=level,
        mode=mode,
        veto_threshold=veto,
    )
    expected = _reference_weights(LR, MASK, level, mode, 2.0, 0.5, veto)
    torch.testing.assert_close(weights, expected, rtol=1e-5, atol=1e-7)
    assert weights.dtype == torch.float32 and not weights.requires_grad
    assert set(metrics) == {f"mismatch/{name}" for name in SEED_METRICS}
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
    # a micro-batch's call (the learner reports the metrics from the batch's): the same weights
    settings = RolloutIS(threshold=2.0, level=level, mode=mode, veto_threshold=veto)
    alone = compute_rollout_importance_weights(*_tensors(LR, MASK), settings, metrics=False)
    assert torch.equal(alone[0], weights) and alone[1] == {}


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_sequence_levels_give_one_weight_per_sequence(level):
    weights, _ = _is(*_tensors(LR, MASK), level=level, threshold=1e6)
    for row, (lr_row, m_row) in enumerate(zip(LR, MASK)):
        valid = [x for x, m in zip(lr_row, m_row) if m]
        log_w = sum(valid) if level == "sequence" else sum(valid) / len(valid)
        expected = 0.0 if row == 2 else math.exp(log_w)  # row 2 is vetoed
        for col, m in enumerate(m_row):
            assert weights[row, col].item() == pytest.approx(expected if m else 0.0, rel=1e-5)


def test_truncate_caps_at_upper_only():
    weights, metrics = _is(*_tensors(LR, MASK), veto_threshold=None)
    assert weights.max().item() == pytest.approx(2.0)
    assert weights[3, 0].item() == pytest.approx(math.exp(-1.0), rel=1e-6)  # below lower: kept
    assert metrics["mismatch/rollout_is_truncated_fraction"] == pytest.approx(1 / 13)
    assert metrics["mismatch/rollout_is_clipped_fraction"] == 0.0


def test_clip_zeroes_outside_bounds_and_lower_defaults_to_reciprocal():
    old, rollout, mask = _tensors([[math.log(0.2), math.log(0.3), math.log(5.0), 0.0]], [[1] * 4])
    weights, metrics = _is(old, rollout, mask, mode="clip", threshold=4.0)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.3, 0.0, 1.0]]))
    assert metrics["mismatch/rollout_is_clipped_fraction"] == pytest.approx(0.5)
    assert metrics["mismatch/rollout_is_truncated_fraction"] == 0.0
    explicit, _ = _is(
        old,
        rollout,
        mask,
        mode="clip",
        threshold=4.0,
        threshold_lower=0.1,
    )
    torch.testing.assert_close(explicit, torch.tensor([[0.2, 0.3, 0.0, 1.0]]))


@pytest.mark.parametrize("level", LEVELS)
def test_veto_zeroes_only_the_sequence_with_a_catastrophic_token(level):
    args = _tensors(LR, MASK)
    vetoed, metrics = _is(*args, level=level, threshold=1e6)
    free, free_metrics = _is(*args, level=level, threshold=1e6, veto_threshold=None)
    assert vetoed[2].abs().sum().item() == 0.0 and free[2].abs().sum().item() > 0.0
    keep = [0, 1, 3]
    torch.testing.assert_close(vetoed[keep], free[keep])
    assert metrics["mismatch/rollout_is_veto_fraction"] == pytest.approx(0.25)
    assert metrics["mismatch/rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 13)
    assert free_metrics["mismatch/rollout_is_veto_fraction"] == 0.0


def test_veto_checks_the_true_unclamped_ratio():
    old, rollout, mask = _tensors([[-25.0, 0.0], [-19.0, 0.0]], [[1, 1], [1, 1]])
    weights, _ = _is(old, rollout, mask, veto_threshold=math.exp(-22.0))
    assert weights[0].sum().item() == 0.0  # -25 < -22 even though the weight clamps at e^-20
    assert weights[1, 1].item() == 1.0


def test_threshold_none_disables_everything():
    for level in LEVELS:
        for mode in MODES:
            assert _is(
                *_tensors(LR, MASK),
                level=level,
                mode=mode,
                threshold=None,
            ) == (None, {})
    assert apply_rollout_is(*_tensors(LR, MASK), RolloutIS(threshold=None)) == (None, {})


def test_metrics_only_mode_returns_full_metrics_and_no_weights():
    args = _tensors(LR, MASK)
    weights, metrics = apply_rollout_is(*args, RolloutIS(apply=False, threshold=2.0))
    _, full = _is(*args)
    assert weights is None and metrics == full
    applied, _ = apply_rollout_is(*args, RolloutIS(apply=True, threshold=2.0))
    assert applied is not None


def test_masked_positions_are_zero_and_change_nothing():
    old, rollout, mask = _tensors(LR, MASK)
    for level in LEVELS:
        w1, m1 = _is(old, rollout, mask, level=level)
        garbage_old = old.clone()
        garbage_old[mask == 0] = torch.tensor([float("nan"), float("-inf"), 1e4])
        garbage_rollout = rollout.clone()
        garbage_rollout[mask == 0] = float("inf")
        w2, m2 = _is(garbage_old, garbage_rollout, mask, level=level)
        assert (w1[mask == 0] == 0).all()
        torch.testing.assert_close(w1, w2)
        assert m1 == m2


def test_hand_computed_metrics_on_a_tiny_example():
    lr = [[0.5, -0.5, 0.0], [1.0, 0.0, 7.0]]
    old, rollout, mask = _tensors(lr, [[1, 1, 1], [1, 1, 0]])
    _, m = _is(old, rollout, mask, veto_threshold=None)
    m = {k.removeprefix("mismatch/"): v for k, v in m.items()}
    valid = [0.5, -0.5, 0.0, 1.0, 0.0]
    w = [math.exp(x) for x in valid]
    w_c = [min(max(x, 0.5), 2.0) for x in w]
    mean_c = sum(w_c) / 5
    ess = 1.0 / (sum((x / mean_c) ** 2 for x in w_c) / 5)
    mean = sum(w) / 5
    expected = {
        "rollout_is_mean": mean,
        "rollout_is_std": math.sqrt(sum((x - mean) ** 2 for x in w) / 5),
        "rollout_is_max": math.e,
        "rollout_is_min": math.exp(-0.5),
        "rollout_is_p50": 1.0,
        "rollout_is_eff_sample_size": ess,
        "rollout_is_ratio_fraction_high": 0.2,
        "rollout_is_ratio_fraction_low": 0.0,
        "rollout_is_truncated_fraction": 0.2,
        "rollout_is_seq_mean": ((w[0] + w[1] + w[2]) / 3 + (w[3] + w[4]) / 2) / 2,
        "rollout_is_seq_max": (w[3] + w[4]) / 2,
        "rollout_is_seq_fraction_high": 0.0,
        "mismatch_kl": -0.2,
        "mismatch_k3_kl": sum(math.exp(x) - x - 1 for x in valid) / 5,
        # rollout logp is -1 everywhere; mean old logp per sequence is -1 and -0.5
        "mismatch_training_log_ppl": (1.0 + 0.5) / 2,
        "mismatch_training_ppl": (math.e + math.exp(0.5)) / 2,
        "mismatch_rollout_log_ppl": 1.0,
        "mismatch_rollout_ppl": math.e,
        "mismatch_log_ppl_diff": (0.0 - 0.5) / 2,
        "mismatch_log_ppl_abs_diff": 0.25,
        "mismatch_log_ppl_diff_max": 0.0,
        "mismatch_log_ppl_diff_min": -0.5,
        "mismatch_ppl_ratio": (1.0 + math.exp(-0.5)) / 2,
    }
    for name, value in expected.items():
        assert m[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    # training ppl / rollout ppl per sequence is exp(log_ppl_diff): ratio of training to rollout
    assert 0 < ess <= 1


def test_percentiles_match_torch_quantile():
    values = torch.rand(101, dtype=torch.float64)
    qs = [0.25, 0.5, 0.75, 0.95, 0.99]
    torch.testing.assert_close(
        quantiles(values, qs, 1.0), torch.quantile(values, torch.tensor(qs, dtype=torch.float64))
    )
    assert quantiles(values[:0], qs, 1.0).tolist() == [1.0] * 5


def test_empty_mask_gives_zero_weights_and_neutral_metrics():
    old, rollout, _ = _tensors(LR, MASK)
    for level in LEVELS:
        weights, m = _is(old, rollout, torch.zeros(4, 4), level=level)
        assert (weights == 0).all()
        assert m["mismatch/rollout_is_eff_sample_size"] == 1.0
        assert m["mismatch/rollout_is_mean"] == 1.0 and m["mismatch/mismatch_ppl_ratio"] == 1.0
        assert m["mismatch/mismatch_kl"] == 0.0 and m["mismatch/rollout_is_veto_fraction"] == 0.0
        assert all(math.isfinite(v) for v in m.values())


def test_single_token_and_batch_of_one():
    old, rollout, mask = _tensors([[0.25]], [[1]])
    for level in LEVELS:
        weights, m = _is(old, rollout, mask, level=level)
        assert weights.item() == pytest.approx(math.exp(0.25), rel=1e-6)
        assert m["mismatch/rollout_is_std"] == 0.0 and m["mismatch/rollout_is_seq_std"] == 0.0
        assert m["mismatch/rollout_is_eff_sample_size"] == pytest.approx(1.0)


def test_weights_are_detached_and_gradients_stay_finite():
    old, rollout, mask = _tensors([[30.0, -30.0, 0.1]], [[1, 1, 1]])
    old.requires_grad_(True)
    weights, _ = _is(old, rollout, mask, level="sequence", veto_threshold=None)
    assert not weights.requires_grad
    (weights * old).sum().backward()
    assert torch.isfinite(old.grad).all()
    torch.testing.assert_close(old.grad, weights)


def test_low_precision_inputs_give_float32_weights():
    old, rollout, mask = _tensors(LR, MASK)
    weights, _ = _is(old.bfloat16(), rollout.bfloat16(), mask.bool())
    assert weights.dtype == torch.float32


@st.composite
def _batches(draw):
    batch, seq = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)
    lr = draw(
        st.lists(st.lists(finite, min_size=seq, max_size=seq), min_size=batch, max_size=batch)
    )
    junk = draw(
        st.lists(st.lists(finite, min_size=seq, max_size=seq), min_size=batch, max_size=batch)
    )
    mask = draw(
        st.lists(
            st.lists(st.booleans(), min_size=seq, max_size=seq), min_size=batch, max_size=batch
        )
    )
    return lr, junk, mask


@settings(max_examples=150, deadline=None)
@given(
    data=_batches(),
    level=st.sampled_from(LEVELS),
    mode=st.sampled_from(MODES),
    veto=st.sampled_from([None, 1e-4]),
    upper=st.floats(1.0, 100.0),
)
def test_property_finite_bounded_and_mask_invariant(data, level, mode, veto, upper):
    lr, junk, mask = data
    old, rollout, m = _tensors(lr, mask)
    kw = dict(level=level, mode=mode, veto_threshold=veto)
    weights, metrics = _is(old, rollout, m, threshold=upper, **kw)
    assert torch.isfinite(weights).all() and (weights >= 0).all()
    assert (weights[m == 0] == 0).all()
    assert (weights <= upper * (1 + 1e-6)).all()
    if mode == "clip":
        nonzero = weights[weights > 0]
        assert (nonzero >= (1 / upper) * (1 - 1e-6)).all()
    assert all(math.isfinite(v) for v in metrics.values())
    assert 0 < metrics["mismatch/rollout_is_eff_sample_size"] <= 1 + 1e-9
    assert metrics["mismatch/mismatch_k3_kl"] >= 0
    # values under mask 0 change nothing
    old2 = torch.where(m.bool(), old, torch.tensor(junk))
    weights2, metrics2 = _is(old2, rollout, m, threshold=upper, **kw)
    torch.testing.assert_close(weights, weights2)
    assert metrics == metrics2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"level": "seq"}, "rollout_is_level must be one of token, sequence, geometric"),
        ({"mode": "mask"}, "rollout_is_mode must be one of truncate, clip"),
        ({"threshold": 0.0}, "rollout_is_threshold must be a positive"),
        ({"threshold": "two"}, "rollout_is_threshold must be a positive number"),
        ({"threshold_lower": 3.0}, "must not exceed"),
        ({"veto_threshold": -1.0}, "rollout_is_veto_threshold must be a positive"),
    ],
)
def test_bad_arguments_raise_one_line_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _is(*_tensors(LR, MASK), **kwargs)


def test_bad_shapes_and_flags_raise():
    old, rollout, mask = _tensors(LR, MASK)
    with pytest.raises(ValueError, match="one shape"):
        _is(old, rollout[:, :2], mask)
    with pytest.raises(ValueError, match="one shape"):
        _is(old[0], rollout[0], mask[0])
    with pytest.raises(ValueError, match="rollout_is must be true or false"):
        apply_rollout_is(old, rollout, mask, RolloutIS(apply="yes", threshold=2.0))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"apply": 1}, "rollout_is must be true or false"),
        ({"level": "seq"}, "rollout_is_level must be one of token, sequence, geometric"),
        ({"mode": "mask", "threshold": None}, "rollout_is_mode must be one of truncate, clip"),
        ({"threshold": float("inf")}, "rollout_is_threshold must be a positive finite"),
        ({"threshold": True}, "rollout_is_threshold must be a positive number"),
        ({"threshold": 2.0, "threshold_lower": 0.0}, "rollout_is_threshold_lower must be a"),
        ({"threshold": 2.0, "threshold_lower": 3.0}, "must not exceed"),
        ({"veto_threshold": 0.0, "threshold": None}, "rollout_is_veto_threshold must be a"),
    ],
)
def test_bad_settings_fail_when_built(settings, message):
    with pytest.raises(ValueError, match=message):
        RolloutIS(**settings)


def test_settings_are_frozen_keyword_only_and_off_without_a_threshold():
    settings = RolloutIS(threshold=2.0)
    with pytest.raises(AttributeError):
        settings.threshold = 3.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        RolloutIS(True, "token")  # type: ignore[misc]
    assert settings.enabled and settings.bounds() == (2.0, 0.5)
    assert RolloutIS(threshold=4, threshold_lower=0.125).bounds() == (4.0, 0.125)
    # as the config validation: the lower bound is only checked against a set threshold
    disabled = RolloutIS(threshold=None, threshold_lower=-1.0)
    assert not disabled.enabled
    assert apply_rollout_is(*_tensors(LR, MASK), disabled) == (None, {})


def test_rollout_is_settings_maps_every_flat_config_key():
    from dataclasses import fields

    from asyncrl.config.schema import AlgorithmConfig
    from asyncrl.learner.objective import rollout_is_settings

    alg = AlgorithmConfig(
        rollout_is=False,
        rollout_is_level="geometric",
        rollout_is_mode="clip",
        rollout_is_threshold=3.0,
        rollout_is_threshold_lower=0.25,
        rollout_is_veto_threshold=1e-3,
    )
    expected = RolloutIS(
        apply=False,
        level="geometric",
        mode="clip",
        threshold=3.0,
        threshold_lower=0.25,
        veto_threshold=1e-3,
    )
    assert rollout_is_settings(alg) == expected
    defaults = rollout_is_settings(AlgorithmConfig())
    assert defaults.apply and defaults.threshold == 2.0 and defaults.veto_threshold == 1e-4
    # every rollout IS key reaches the settings, except the post-rejection batch normalisation
    keys = {f.name for f in fields(AlgorithmConfig) if f.name.startswith("rollout_is")}
    mapped = {
        "rollout_is" if f.name == "apply" else f"rollout_is_{f.name}" for f in fields(RolloutIS)
    }
    assert keys - mapped == {"rollout_is_batch_normalize"} and mapped <= keys


# Rejection sampling. lr rows: k1 = -lr, k2 = lr²/2, k3 = e^lr - 1 - lr.
RS_LR = [[0.5, -1.0, 0.1], [2.0, 0.0, 100.0], [-0.2, -0.2, -0.2]]
RS_MASK = [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
ALL = [1, 1, 1]
NONE = [0, 0, 0]


@pytest.mark.parametrize(
    ("criterion", "expected"),
    [
        (("token_k1", -0.3, 0.5), [[0, 0, 1], [0, 1, 0], ALL]),
        (("token_k2", None, 0.2), [[1, 0, 1], [0, 1, 0], ALL]),
        (("token_k2", 0.01, None), [[1, 1, 0], [1, 0, 0], ALL]),
        (("token_k3", None, 0.2), [[1, 0, 1], [0, 1, 0], ALL]),
        (("seq_sum_k1", -0.5, 0.5), [ALL, NONE, NONE]),  # sums 0.4, -2.0, 0.6
        (("seq_sum_k2", None, 0.5), [NONE, NONE, ALL]),  # 0.63, 2.0, 0.06
        (("seq_sum_k3", None, 0.5), [NONE, NONE, ALL]),  # 0.522, 4.39, 0.056
        (("seq_mean_k1", -0.5, 0.15), [ALL, NONE, NONE]),  # 0.133, -1.0, 0.2
        (("seq_mean_k2", None, 0.3), [ALL, NONE, ALL]),  # 0.21, 1.0, 0.02
        (("seq_mean_k3", None, 0.3), [ALL, NONE, ALL]),  # 0.174, 2.19, 0.019
        (("seq_max_k2", None, 0.4), [NONE, NONE, ALL]),  # 0.5, 2.0, 0.02
        (("seq_max_k3", None, 0.4), [ALL, NONE, ALL]),  # 0.368, 4.39, 0.019
    ],
)
def test_rejection_criterion_hand_computed(criterion, expected):
    old, rollout, mask = _tensors(RS_LR, RS_MASK)
    before = mask.clone()
    new_mask, metrics = rejection_mask(old, rollout, mask, [criterion])
    expected_t = torch.tensor(expected, dtype=torch.float32) * before
    torch.testing.assert_close(new_mask, expected_t)
    torch.testing.assert_close(mask, before)  # input untouched
    removed = 1 - expected_t.sum().item() / before.sum().item()
    assert metrics["rejection/masked_token_fraction"] == pytest.approx(removed)
    assert f"rejection/{criterion[0]}_fraction" in metrics


def test_rejection_chains_with_and_independent_of_order():
    old, rollout, mask = _tensors(RS_LR, RS_MASK)
    crit = [
        RejectionCriterion("token_k2", upper=0.2),
        RejectionCriterion("seq_mean_k1", -0.5, 0.15),
    ]
    a, ma = rejection_mask(old, rollout, mask.bool(), crit)
    b, mb = rejection_mask(old, rollout, mask.bool(), crit[::-1])
    expected = torch.tensor([[1, 0, 1], [0, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert a.dtype == torch.bool and torch.equal(a, expected) and torch.equal(b, expected)
    assert ma == mb
    assert ma["rejection/token_k2_fraction"] == pytest.approx(2 / 8)
    assert ma["rejection/seq_mean_k1_fraction"] == pytest.approx(2 / 3)
    assert ma["rejection/masked_seq_fraction"] == pytest.approx(2 / 3)


def test_rejection_arguments_are_validated():
    old, rollout, mask = _tensors(RS_LR, RS_MASK)
    bad = [
        ([("seq_max_k1", None, 1.0)], "rejection criterion must be one of"),
        ([("token_k1", None, None)], "needs a lower or an upper bound"),
        ([("token_k1", 2.0, 1.0)], "exceeds upper"),
        ([("token_k1", None, 1.0), ("token_k1", None, 2.0)], "repeat token_k1"),
        (["token_k1"], r"is \(name, lower, upper\)"),
        ([3.0], r"is \(name, lower, upper\)"),
    ]
    for criteria, message in bad:
        with pytest.raises(ValueError, match=message):
            rejection_mask(old, rollout, mask, criteria)
    record = SimpleNamespace(name="seq_max_k3", lower=None, upper=0.4)  # a config-like record
    from_record, _ = rejection_mask(old, rollout, mask, [record])
    torch.testing.assert_close(from_record, torch.tensor([ALL, NONE, ALL]) * mask)
    empty, metrics = rejection_mask(old, rollout, mask, [])
    torch.testing.assert_close(empty, mask)
    assert metrics["rejection/masked_token_fraction"] == 0.0


def test_normalize_weights_to_batch_mean():
    weights = torch.tensor([[2.0, 1.0, 9.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = normalize_weights_to_batch_mean(weights, mask)
    torch.testing.assert_close(out, torch.tensor([[4 / 3, 2 / 3, 0.0], [2.0, 0.0, 0.0]]))
    assert out[mask.bool()].mean().item() == pytest.approx(1.0)
    zeros = normalize_weights_to_batch_mean(torch.zeros(2, 3), mask)
    assert torch.equal(zeros, torch.zeros(2, 3))
    assert torch.equal(
        normalize_weights_to_batch_mean(weights, torch.zeros(2, 3)), torch.zeros(2, 3)
    )


def test_batch_normalize_at_sequence_levels_divides_by_the_mean_over_sequences():
    # verl rollout_corr_math.md: w~_seq = w_seq / E[w_seq], E over sequences. Sequence weights
    # 2 (2 tokens) and 1 (3 tokens); an empty row counts nowhere. Sequence mean 1.5, whereas
    # the token mean would be 7 / 5.
    weights = torch.tensor([[2.0, 2.0, 0.0], [1.0, 1.0, 1.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    want = torch.tensor([[4 / 3, 4 / 3, 0.0], [2 / 3, 2 / 3, 2 / 3], [0.0, 0.0, 0.0]])
    for level in ("sequence", "geometric"):
        torch.testing.assert_close(normalize_weights_to_batch_mean(weights, mask, level), want)
    by_token = normalize_weights_to_batch_mean(weights, mask, "token")
    torch.testing.assert_close(
        by_token, torch.tensor([[10 / 7] * 2 + [0.0], [5 / 7] * 3, [0.0] * 3])
    )
    # a vetoed sequence (weight 0, still valid) counts in the mean; nothing valid: unchanged
    vetoed = weights.clone()
    vetoed[1] = 0.0
    out = normalize_weights_to_batch_mean(vetoed, mask, "sequence")
    torch.testing.assert_close(out[0], torch.tensor([2.0, 2.0, 0.0]))  # mean (2 + 0) / 2 = 1
    zero = normalize_weights_to_batch_mean(torch.zeros(3, 3), mask, "sequence")
    assert torch.equal(zero, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="rollout_is_level"):
        normalize_weights_to_batch_mean(weights, mask, "batch")


def test_learner_batch_normalizes_sequence_weights_over_sequences():
    from asyncrl.config.schema import AlgorithmConfig
    from asyncrl.learner.objective import correct, rollout_is_settings

    alg = AlgorithmConfig(
        rollout_is_level="sequence", rollout_is_batch_normalize=True, rollout_is_veto_threshold=None
    )
    old, rollout, mask = _tensors([[0.5, 0.0, 0.0], [0.0, -0.5, 0.0]], [[1, 0, 0], [1, 1, 1]])
    weights, _, _ = correct(alg, rollout_is_settings(alg), "vanilla", old, rollout, mask)
    per_seq = weights[:, 0]
    assert per_seq.mean().item() == pytest.approx(1.0)
    assert (per_seq[0] / per_seq[1]).item() == pytest.approx(math.e, rel=1e-6)


def test_seq_std_is_unbiased_and_std_is_over_token_weights():
    # token level: per-sequence mean weights a, b, c over three non-empty rows (a 4th is empty)
    lr = [[0.5, -0.5, 0.0], [1.0, 0.0, 0.0], [0.2, 0.0, 0.0], [3.0, 3.0, 3.0]]
    mask = [[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]]
    _, m = _is(*_tensors(lr, mask), veto_threshold=None)
    seq = [(math.exp(0.5) + math.exp(-0.5) + 1) / 3, (math.e + 1) / 2, math.exp(0.2)]
    mean = sum(seq) / 3
    unbiased = math.sqrt(sum((x - mean) ** 2 for x in seq) / 2)
    assert m["mismatch/rollout_is_seq_std"] == pytest.approx(unbiased, rel=1e-6)
    # rollout_is_std: population std of the six valid token weights, before truncation
    w = [math.exp(x) for x in (0.5, -0.5, 0.0, 1.0, 0.0, 0.2)]
    mu = sum(w) / 6
    assert m["mismatch/rollout_is_std"] == pytest.approx(
        math.sqrt(sum((x - mu) ** 2 for x in w) / 6), rel=1e-6
    )
    # sequence level: the sequence weight itself; one sequence has std 0, not NaN
    _, m_seq = _is(*_tensors(lr[:2], mask[:2]), level="sequence", veto_threshold=None)
    a, b = math.exp(0.0), math.exp(1.0)
    assert m_seq["mismatch/rollout_is_seq_std"] == pytest.approx(abs(a - b) / math.sqrt(2))
    _, one = _is(*_tensors(lr[:1], mask[:1]), level="sequence")
    assert one["mismatch/rollout_is_seq_std"] == 0.0


def test_bypass_uses_rollout_log_probs_and_weights_become_one():
    _, rollout, mask = _tensors(LR, MASK)
    recomputed = rollout + 0.3
    old = select_old_log_prob("bypass", rollout, recomputed)
    assert old is rollout
    weights, metrics = _is(old, rollout, mask)
    assert torch.equal(weights, mask)
    assert metrics["mismatch/mismatch_kl"] == 0.0
    assert select_old_log_prob("bypass", rollout) is rollout


def test_decoupled_requires_recomputed_log_probs():
    _, rollout, _ = _tensors(LR, MASK)
    recomputed = rollout + 0.3
    assert select_old_log_prob("decoupled", rollout, recomputed) is recomputed
    with pytest.raises(ValueError, match="decoupled mode needs recomputed_log_prob"):
        select_old_log_prob("decoupled", rollout, None)
    with pytest.raises(ValueError, match="one of bypass, decoupled; got 'recompute'"):
        select_old_log_prob("recompute", rollout, recomputed)

"""The untruncated sequence-level ratios' ESS by staleness (`algo.lag_stats`,
`is/seq_ess_by_lag/<k>`): closed forms of (Σw)² / (n·Σw²) with w = exp(Σ_t old - rollout),
kept finite in log space, and independent of how the loss's IS weights are bounded."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algo.importance import ess_from_lag_sums
from asyncrl.algo.lag_stats import (
    row_log_ratios,
    seq_ess_by_lag,
    seq_ratio_lag_sums,
    seq_shift_max,
)
from asyncrl.config.schema import AlgorithmConfig
from asyncrl.learner import objective as obj


def _rows(log_ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old, rollout, mask) whose valid tokens' old - rollout are the given values (rows padded
    with masked garbage that must not count)."""
    width = max(len(r) for r in log_ratios) + 1
    old = torch.full((len(log_ratios), width), 50.0)  # masked: would dominate if counted
    mask = torch.zeros(len(log_ratios), width)
    for i, row in enumerate(log_ratios):
        old[i, : len(row)] = torch.tensor(row, dtype=torch.float64).float()
        mask[i, : len(row)] = 1.0
    rollout = torch.zeros_like(old)
    return old.double(), rollout.double(), mask


def test_known_sequence_ratios():
    # lag 1: sequence ratios 1, 2, 3 split over tokens (products of token ratios): 36 / (3·14);
    # lag 0: one row; lag 2: equal ratios -> 1.
    l2, l3 = math.log(2), math.log(3)
    old, rollout, mask = _rows([[0.0, 0.0], [l2 / 2, l2 / 2], [l3, 0.0, 0.0], [0.3], [1.0], [1.0]])
    got = seq_ess_by_lag(old, rollout, mask, torch.tensor([1, 1, 1, 0, 2, 2]))
    assert got[1] == (pytest.approx(36 / 42), 3)
    assert got[0] == (pytest.approx(1.0), 1)
    assert got[2] == (pytest.approx(1.0), 2)


def test_huge_log_ratios_stay_finite():
    # exp(±1000) overflows / underflows any float; the ESS only depends on the differences.
    for base in (1000.0, -1000.0):
        old, rollout, mask = _rows([[base / 2, base / 2], [base, math.log(2)]])
        got = seq_ess_by_lag(old, rollout, mask, torch.tensor([3, 3]))
        assert got[3] == (pytest.approx(9 / 10), 2)  # ratios (1, 2) · e^base


def test_one_dominant_sequence_is_one_over_n_and_empty_rows_are_left_out():
    old, rollout, mask = _rows([[800.0], [0.0], [0.0], [0.0]])
    mask[3] = 0.0  # no valid token: not a sample
    got = seq_ess_by_lag(old, rollout, mask, torch.tensor([1, 1, 1, 7]))
    assert set(got) == {1}
    assert got[1] == (pytest.approx(1 / 3), 3)


def test_lognormal_ratios_have_ess_exp_minus_variance():
    # s ~ N(0, σ²): E[w]² / E[w²] = exp(σ²) / exp(2σ²) = exp(-σ²).
    gen = torch.Generator().manual_seed(0)
    sigma = 0.6
    s = torch.randn(400_000, 1, generator=gen, dtype=torch.float64) * sigma
    got = seq_ess_by_lag(s, torch.zeros_like(s), torch.ones_like(s), torch.zeros(len(s)).long())
    assert got[0][0] == pytest.approx(math.exp(-(sigma**2)), rel=0.02)


def test_shards_with_different_maxima_add_up_to_the_batch():
    # What the FSDP reduce relies on: the maxima by MAX, then the shifted sums by SUM.
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(8, 6, generator=gen, dtype=torch.float64) * 3
    mask = (torch.rand(8, 6, generator=gen) > 0.3).float()
    rollout, lags = torch.zeros_like(old), torch.tensor([0, 2, 1, 2, 0, 2, 2, 1])
    parts = [
        row_log_ratios(old[a:b], rollout[a:b], mask[a:b], lags[a:b]) for a, b in ((0, 3), (3, 8))
    ]
    shifts = [seq_shift_max(*p) for p in parts]
    size = max(len(x) for x in shifts)
    pad = [torch.cat((x, torch.full((size - len(x),), -math.inf, dtype=x.dtype))) for x in shifts]
    shift = torch.maximum(*pad)
    total = sum(seq_ratio_lag_sums(*p, shift) for p in parts)
    got, whole = ess_from_lag_sums(total), seq_ess_by_lag(old, rollout, mask, lags)
    assert set(got) == set(whole) == {0, 1, 2}
    assert all(got[k][0] == pytest.approx(whole[k][0]) and got[k][1] == whole[k][1] for k in got)
    assert min(v for v, _ in whole.values()) < 0.9  # log-ratios of sd ~7: far from uniform
    with pytest.raises(ValueError, match="has no shift"):
        seq_ratio_lag_sums(*parts[1], shift[:2])


def test_correct_reports_the_shift_the_bounded_weights_hide():
    # Per-token ratios 1.1 over 40 tokens in two rows, 1 in two: the geometric-mean weights are
    # (1.1, 1.1, 1, 1), the sequence weights truncated at 2 (2, 2, 1, 1): both ESS >= 0.9; the
    # sequence ratios (1.1^40 = 45.3, 45.3, 1, 1): ESS 0.52.
    alg = AlgorithmConfig(rollout_is=True, rollout_is_threshold=2.0, rollout_is_level="geometric")
    old = torch.zeros(4, 40, dtype=torch.float64)
    old[:2] = math.log(1.1)
    rollout, mask, lags = torch.zeros_like(old), torch.ones(4, 40), torch.tensor([1, 1, 1, 1])
    kept = {"geometric": [1.1, 1.1, 1.0, 1.0], "sequence": [2.0, 2.0, 1.0, 1.0]}
    ess = lambda w: sum(w) ** 2 / (len(w) * sum(x * x for x in w))  # noqa: E731
    for level, weights in kept.items():
        alg.rollout_is_level = level
        settings = obj.rollout_is_settings(alg)
        _, _, metrics = obj.correct(alg, settings, "vanilla", old, rollout, mask, lags)
        assert metrics["is/seq_ess_by_lag/1"] == pytest.approx(ess([1.1**40] * 2 + [1.0] * 2))
        assert metrics["is/seq_units_by_lag/1"] == 4.0 and metrics["is/seq_ess_by_lag/1"] < 0.6
        assert metrics["is/ess_by_lag/1"] == pytest.approx(ess(weights)) and ess(weights) >= 0.9

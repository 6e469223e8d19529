"""The distribution shift by staleness, measured on the log-probs, not on the IS weights.

`importance.lag_sums` gives the ESS of the weights the loss applies; those are truncated,
clipped or geometric means, built to hide the shift from the gradient, so their ESS stays near
1 long after the policy has moved. This module measures the shift itself: the normalised
effective sample size of the untruncated sequence-level importance ratios

    w_i = π_learner(y_i | x_i) / π_behaviour(y_i | x_i) = exp(s_i),   s_i = Σ_t (old_t - rollout_t)

over the rows of one lag, (Σw)² / (n·Σw²) (Kong's ESS: how many on-policy samples the lag's n
samples are worth to an unbiased estimate under the learner's policy, whatever correction the
loss then applies). For a log-normal ratio with variance σ² of s it is exp(-σ²).

The products overflow any float, so the sums are kept in log space: per lag, the largest s
(`m_k`) is taken first and the sums are of exp(s - m_k) and exp(2(s - m_k)); both hold the
term 1 of the largest row, so neither underflows to 0, and the ESS does not depend on the
shift. Shards of one batch combine in two steps (`seq_shift_max`, then `seq_ratio_lag_sums`
with the all-reduced maxima): the maxima by MAX, the sums by SUM.
"""

from __future__ import annotations

import torch

from asyncrl.algo.importance import check_lags, check_same_shape, ess_from_lag_sums


def row_log_ratios(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, lags: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s [n] float64, lag [n] int64) of the rows with a valid token: s the row's log
    sequence ratio Σ_t (old - rollout) over its valid tokens, untruncated."""
    check_same_shape(old=old, rollout=rollout, mask=mask)
    check_lags(lags, old.shape[0])
    valid = mask.bool()
    diff = old.detach().to(torch.float64) - rollout.detach().to(torch.float64)
    s = torch.where(valid, diff, 0.0).sum(dim=-1)
    rows = valid.any(dim=-1)
    return s[rows].cpu(), lags[rows].cpu().to(torch.int64)


def seq_shift_max(s: torch.Tensor, lag: torch.Tensor) -> torch.Tensor:
    """[L + 1] float64: each lag's largest s (-inf where the lag holds no row); L the largest
    lag holding a row (an empty tensor when none does)."""
    size = int(lag.max()) + 1 if lag.numel() else 0
    out = torch.full((size,), float("-inf"), dtype=torch.float64)
    return out.scatter_reduce_(0, lag, s, reduce="amax")


def seq_ratio_lag_sums(s: torch.Tensor, lag: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """[len(shift), 3] float64: per lag k, Σ exp(s - shift_k), Σ exp(2(s - shift_k)) and the
    count of its rows. `shift` >= every row's s at its lag (`seq_shift_max`, all-reduced by
    MAX over shards), so every term is in (0, 1]; lags past `shift`'s end are refused."""
    if lag.numel() and int(lag.max()) >= shift.shape[0]:
        raise ValueError(f"a row at lag {int(lag.max())} has no shift (lags 0..{len(shift) - 1})")
    safe = torch.where(torch.isfinite(shift), shift, 0.0)
    d = s - safe[lag]
    columns = torch.stack((d.exp(), (2 * d).exp(), torch.ones_like(d)), dim=-1)
    return torch.zeros(shift.shape[0], 3, dtype=torch.float64).index_add_(0, lag, columns)


def seq_ess_by_lag(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, lags: torch.Tensor
) -> dict[int, tuple[float, int]]:
    """{lag: (normalised ESS of the untruncated sequence ratios, rows)} of one batch on one
    process (the sums' ESS: `importance.ess_from_lag_sums`)."""
    s, lag = row_log_ratios(old, rollout, mask, lags)
    return ess_from_lag_sums(seq_ratio_lag_sums(s, lag, seq_shift_max(s, lag)))

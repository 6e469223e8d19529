"""What the learner measures of a batch by staleness: each row's lag (`sequence_lags`) and, per
lag, the ESS of the IS weights, the k3 KL and the ESS of the untruncated sequence ratios
(`lag_metrics`), the signals `max_staleness: auto` steers by (`replay/staleness_control.py`).
Over FSDP ranks the per-lag sums are all-reduced, so every rank reports the whole batch's."""

from __future__ import annotations

import math

import torch

from asyncrl.algo.importance import ess_from_lag_sums, kl_from_lag_sums, kl_lag_sums, lag_sums
from asyncrl.algo.lag_stats import row_log_ratios, seq_ratio_lag_sums, seq_shift_max
from asyncrl.types import NOT_GENERATED


def sequence_lags(versions: torch.Tensor, version: int) -> torch.Tensor:
    """Each row's staleness [B] (int64) when the learner at `version` trains on it: `version`
    minus the oldest weight version that generated any of the row's tokens (`versions` [B, R],
    NOT_GENERATED on padding and environment tokens). The definition of
    `replay/staleness_hist` (`metrics/batch.py`), per sequence rather than per group: with
    per-token versions a continued response is as stale as its oldest token. A row with no
    generated token gets lag 0 (it has no valid token to weigh either)."""
    generated = versions != NOT_GENERATED
    oldest = torch.where(generated, versions, torch.iinfo(versions.dtype).max).amin(dim=-1)
    lags = torch.where(generated.any(dim=-1), version - oldest, 0)
    return lags.to(torch.int64)


def lag_metrics(
    weights: torch.Tensor,
    mask: torch.Tensor,
    lags: torch.Tensor,
    level: str,
    all_ranks: bool = False,
    logprobs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, float]:
    """`is/ess_by_lag/<k>`: the normalised ESS of the IS weights of the lag-k rows (tokens or
    sequences, per `level`: `algo.importance.lag_sums`); `is/units_by_lag/<k>`: how many
    tokens or sequences that ESS is over. With `logprobs` (old, rollout), the shift itself,
    whatever the weights: `is/kl_by_lag/<k>`, the mean per-token k3 KL(rollout || old) over
    the lag-k rows' tokens (`algo.importance.kl_lag_sums`), and `is/seq_ess_by_lag/<k>` over
    `is/seq_units_by_lag/<k>` rows, the normalised ESS of their untruncated sequence-level
    ratios (`algo.lag_stats`). `all_ranks`: every rank of the default process group holds a
    shard of the batch and calls this at the same point (the FSDP learner); the sums are
    all-reduced, so every rank reports the whole batch's figures under the same keys (what
    `fsdp.mean_over_ranks` needs) and each ESS is the batch's, not a mean of shards'."""
    sums = lag_sums(weights, mask, lags, level)
    if all_ranks:
        sums = _sum_over_ranks(sums)
    out: dict[str, float] = {}
    for lag, (ess, n) in ess_from_lag_sums(sums).items():
        out[f"is/ess_by_lag/{lag}"], out[f"is/units_by_lag/{lag}"] = ess, float(n)
    if logprobs is not None:
        out.update(_shift_by_lag(*logprobs, mask, lags, all_ranks))
    return out


def _shift_by_lag(
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    lags: torch.Tensor,
    all_ranks: bool,
) -> dict[str, float]:
    """The KL and sequence-ratio ESS by lag (see `lag_metrics`), over ranks when `all_ranks`:
    the ratio sums in two collectives, each lag's largest log-ratio (MAX), then the sums
    shifted by it (SUM)."""
    kl = kl_lag_sums(old, rollout, mask, lags)
    s, row_lag = row_log_ratios(old, rollout, mask, lags)
    shift = seq_shift_max(s, row_lag)
    if all_ranks:
        kl = _sum_over_ranks(kl)
        shift = _sum_over_ranks(shift.unsqueeze(-1), max_=True).squeeze(-1)
    seq = seq_ratio_lag_sums(s, row_lag, shift)
    if all_ranks:
        seq = _sum_over_ranks(seq)
    out = {f"is/kl_by_lag/{lag}": value for lag, value in kl_from_lag_sums(kl).items()}
    for lag, (ess, n) in ess_from_lag_sums(seq).items():
        out[f"is/seq_ess_by_lag/{lag}"], out[f"is/seq_units_by_lag/{lag}"] = ess, float(n)
    return out


def _sum_over_ranks(sums: torch.Tensor, max_: bool = False) -> torch.Tensor:
    """Per-lag rows [L + 1, C] added (or, `max_`, maximised) over the default group's ranks
    (CPU tensors, as `mean_over_ranks`): first the longest lag range, so every rank reduces
    tensors of one shape (the padding is 0 for a sum, -inf for a max)."""
    import torch.distributed as dist

    size = torch.tensor([sums.shape[0]], dtype=torch.int64)
    dist.all_reduce(size, op=dist.ReduceOp.MAX)
    padded = torch.full((int(size), sums.shape[1]), -math.inf if max_ else 0.0, dtype=torch.float64)
    padded[: sums.shape[0]] = sums
    dist.all_reduce(padded, op=dist.ReduceOp.MAX if max_ else dist.ReduceOp.SUM)
    return padded

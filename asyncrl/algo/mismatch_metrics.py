"""Diagnostics of the rollout/training mismatch and of rollout IS weights (pure torch).

Every statistic here is a 0-d float64 tensor; `to_floats` turns a dict of them into python
floats with one device sync. The names are the seed verl PR's (without the `mismatch/` prefix,
which the caller adds).

Invariants:
- Only positions where the mask is true enter a statistic. Token statistics run on the valid
  entries, compacted once (`ValidTokens`), so inf/nan padding under mask 0 cannot leak in, and
  no statistic re-masks or re-converts a whole padded [batch, seq_len] tensor (that cost ~5x
  the policy loss on a 256 x 4096 batch).
- Sequence statistics run over non-empty sequences (at least one valid token); an all-padding
  row counts nowhere.
- Every result is finite for finite inputs: statistics run in float64 and every exponent is
  bounded (`METRIC_LOG_BOUND`).
- With no valid token at all, a statistic takes its neutral value: 1.0 for weight-like and
  perplexity-like values (IS weight stats, ESS, ppl, ppl_ratio), 0.0 for fractions, std, KL
  and log-ppl statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from asyncrl.algo import agg

# exp(50) ≈ 5e21: far above any meaningful perplexity or k3 value, far below float64 overflow.
METRIC_LOG_BOUND = 50.0
QUANTILES: dict[str, float] = {"p25": 0.25, "p50": 0.50, "p75": 0.75, "p95": 0.95, "p99": 0.99}
F64 = torch.float64


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, empty: float = 0.0
) -> torch.Tensor:
    """Mean of `x` where `mask` (bool) is true; `empty` where nothing is valid."""
    mean = agg.masked_mean(x, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return torch.where(count > 0, mean, torch.full_like(mean, empty))


def masked_max(
    x: torch.Tensor, mask: torch.Tensor, empty: float, any_valid: bool | None = None
) -> torch.Tensor:
    """Largest valid entry of `x`; `empty` when nothing is valid. A caller that already knows
    `any_valid` passes it, sparing the device sync of finding out."""
    if any_valid is None:
        any_valid = bool(mask.any())
    if not any_valid:
        return torch.tensor(empty, dtype=x.dtype, device=x.device)
    return torch.where(mask, x, torch.full_like(x, -torch.inf)).max()


def masked_min(
    x: torch.Tensor, mask: torch.Tensor, empty: float, any_valid: bool | None = None
) -> torch.Tensor:
    """Smallest valid entry of `x`; `empty` when nothing is valid."""
    return -masked_max(-x, mask, -empty, any_valid)


def masked_std(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """Standard deviation of the valid entries (0 for fewer than two): population by default,
    with `unbiased` the sample one (divided by n - 1, as `torch.std`)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    if unbiased:
        n = mask.sum().to(var.dtype)
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), torch.zeros_like(var))
    return var.sqrt()


@dataclass(frozen=True)
class ValidTokens:
    """The valid positions of a [batch, seq_len] mask, found once and shared by every metric.

    Row-major order keeps each row's tokens contiguous and in order, so per-row sums are one
    `index_add_` over the compacted values rather than a masked reduction of the padded matrix.
    """

    index: torch.Tensor  # flat position of each valid token, int64 [n], ascending
    rows: torch.Tensor  # the row of each valid token, int64 [n]
    counts: torch.Tensor  # valid tokens per row, float64 [batch] (exact integers)
    nonempty: torch.Tensor  # rows holding at least one valid token, bool [batch]
    n: int  # on the host: compacting synced once already, so empty checks cost nothing

    @classmethod
    def of(cls, valid: torch.Tensor) -> ValidTokens:
        """Compact a bool [batch, seq_len] mask (one device sync, as any boolean indexing)."""
        batch, seq_len = valid.shape
        index = valid.reshape(-1).nonzero().squeeze(1)
        rows = index // max(seq_len, 1)
        # Row b's tokens start at the first index >= b * seq_len: batch + 1 binary searches
        # count every row, far cheaper than reducing the padded mask.
        starts = torch.arange(batch + 1, device=valid.device) * seq_len
        counts = torch.searchsorted(index, starts).diff().to(F64)
        return cls(index, rows, counts, counts > 0, index.numel())

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The valid entries of a [batch, seq_len] tensor, 1-D in row-major order."""
        return x.reshape(-1).index_select(0, self.index)

    def row_mean(self, values: torch.Tensor, empty: float = 0.0) -> torch.Tensor:
        """Per-row mean of compacted `values` (float64), [batch]; `empty` for empty rows."""
        sums = torch.zeros(self.counts.shape, dtype=values.dtype, device=values.device)
        sums.index_add_(0, self.rows, values)
        return torch.where(self.nonempty, sums / self.counts.clamp(min=1), empty)


@dataclass(frozen=True)
class Sample:
    """`n` token values: `values` holds one per valid token (`counts` None), or one per row
    standing for that row's `counts` valid tokens (sequence-level IS weights). Weighting rows
    by their counts gives the statistics of the values broadcast over the tokens without
    materialising, masking or sorting them."""

    values: torch.Tensor
    counts: torch.Tensor | None
    n: int

    @cached_property
    def f64(self) -> torch.Tensor:
        """`values` in float64, converted once for every statistic that accumulates them."""
        return self.values.to(F64)

    def mean(self, x: torch.Tensor, empty: float = 0.0) -> torch.Tensor:
        """Mean over the `n` tokens of `x` (float64, aligned with `values`)."""
        if self.n == 0:
            return torch.tensor(empty, dtype=F64, device=x.device)
        total = x.sum() if self.counts is None else (x * self.counts).sum()
        return total / self.n

    def fraction(self, flags: torch.Tensor) -> torch.Tensor:
        """Fraction of the `n` tokens whose flag (bool, aligned with `values`) is set; exact,
        since it counts integers (in float64 when weighted, exact below 2**53)."""
        if self.counts is not None:
            return self.mean(flags.to(F64))
        hits = flags.count_nonzero().to(F64)  # several times cheaper than summing bools
        return hits / self.n if self.n else torch.zeros_like(hits)

    def extreme(self, largest: bool, empty: float) -> torch.Tensor:
        """Largest (or smallest) value over the tokens, in float64; `empty` with none."""
        v = self.f64
        if self.counts is None:
            if self.n == 0:
                return torch.tensor(empty, dtype=F64, device=v.device)
            return v.max() if largest else v.min()
        fn = masked_max if largest else masked_min
        return fn(v, self.counts > 0, empty, any_valid=self.n > 0)


def _positions(qs: list[float], n: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Sorted-order positions around each quantile and the interpolation fraction."""
    pos = torch.tensor(qs, dtype=F64, device=like.device) * (n - 1)
    lo, hi = pos.floor().long(), pos.ceil().long()
    return lo, hi, (pos - lo.to(F64)).to(like.dtype)


def _sorted(values: torch.Tensor, positive: bool) -> torch.Tensor:
    """`values` in ascending order. The bit patterns of positive float32 values order as int32
    the same way, and the CPU sorts int32 about a third faster than float32; the sort is most
    of the cost of the IS metrics. Clearing the sign bit first changes no positive value and
    puts a NaN of either sign last, where a float sort puts it."""
    if positive and values.dtype == torch.float32:
        bits = values.view(torch.int32) & 0x7FFFFFFF
        return bits.sort().values.view(torch.float32)
    return values.sort().values


def quantiles(
    values: torch.Tensor, qs: list[float], empty: float, positive: bool = False
) -> torch.Tensor:
    """Linear-interpolation quantiles of a 1-D tensor, as `torch.quantile` computes them.

    Sort-based because `torch.quantile` refuses inputs above 2**24 elements, which a large
    batch of long responses exceeds. `positive`: the caller guarantees every value is > 0
    (IS weights are exp of a bounded log-weight), which allows a faster sort.
    """
    if values.numel() == 0:
        return torch.full((len(qs),), empty, dtype=values.dtype, device=values.device)
    ordered = _sorted(values, positive)
    lo, hi, frac = _positions(qs, values.numel(), values)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * frac


def sample_quantiles(
    sample: Sample, qs: list[float], empty: float, positive: bool = False
) -> torch.Tensor:
    """`quantiles` of the `n` token values; with counts, the k-th smallest token value is the
    sorted value whose running count first exceeds k, so only `batch` values get sorted."""
    values = sample.values
    if sample.counts is None:
        return quantiles(values, qs, empty, positive)
    if sample.n == 0:
        return torch.full((len(qs),), empty, dtype=values.dtype, device=values.device)
    ordered, order = values.sort()
    running = sample.counts[order].cumsum(0)  # float64, exact integers; empty rows add 0
    lo, hi, frac = _positions(qs, sample.n, values)

    def kth(k: torch.Tensor) -> torch.Tensor:
        return ordered[torch.searchsorted(running, k.to(F64), right=True)]

    low = kth(lo)
    return low + (kth(hi) - low) * frac


def weight_distribution(raw: Sample) -> dict[str, torch.Tensor]:
    """Mean, std, percentiles, max and min of the weights over valid tokens.

    `raw` is the safety-bounded weights before truncate/clip/veto, one per valid token (a
    sequence weight counted once per valid token); `rollout_is_std` is their population
    standard deviation, sqrt(mean((w - mean w)^2)) over those tokens.
    """
    mean = raw.mean(raw.f64, empty=1.0)
    # in place on the fresh difference: one n-sized temporary instead of two
    stats = {"rollout_is_mean": mean, "rollout_is_std": raw.mean((raw.f64 - mean).square_()).sqrt()}
    # Sorting dominates the cost; the weights' own dtype is exact enough for percentiles.
    qs = sample_quantiles(raw, list(QUANTILES.values()), 1.0, positive=True).to(F64)
    for i, name in enumerate(QUANTILES):
        stats[f"rollout_is_{name}"] = qs[i]
    stats["rollout_is_max"] = raw.extreme(largest=True, empty=1.0)
    stats["rollout_is_min"] = raw.extreme(largest=False, empty=1.0)
    return stats


def effective_sample_size(raw: Sample, lower: float, upper: float) -> torch.Tensor:
    """ESS as a fraction in (0, 1]: 1 / mean(w̃²), w̃ = w_c / mean(w_c), w_c = clamp(w, lower, upper).

    Clamping first keeps one huge weight from collapsing the statistic to ~0; w_c >= lower > 0,
    so the normalising mean is never zero when a token is valid.
    """
    clamped = raw.f64.clamp(min=lower, max=upper)
    normalised = clamped.div_(raw.mean(clamped, empty=1.0))  # in place: clamped is ours
    return 1.0 / raw.mean(normalised.square_(), empty=1.0)


def threshold_fractions(log_weights: Sample, lower: float, upper: float) -> dict[str, torch.Tensor]:
    """Fractions of valid tokens whose true (unclamped, log-space) weight leaves [lower, upper]."""
    lw = log_weights.values.to(F64)  # compared in float64, against float64 log-bounds
    return {
        "rollout_is_ratio_fraction_high": log_weights.fraction(lw > math.log(upper)),
        "rollout_is_ratio_fraction_low": log_weights.fraction(lw < math.log(lower)),
    }


def sequence_stats(
    seq_w: torch.Tensor, tokens: ValidTokens, lower: float, upper: float
) -> dict[str, torch.Tensor]:
    """Statistics of the per-sequence mean weight `seq_w` (float64 [batch]) over non-empty
    sequences. At sequence and geometric level it is the sequence's weight itself. The std is
    the unbiased one (verl: `seq_mean_weights.std()`), 0 for fewer than two sequences."""
    nonempty, any_valid = tokens.nonempty, tokens.n > 0
    return {
        "rollout_is_seq_mean": masked_mean(seq_w, nonempty, empty=1.0),
        "rollout_is_seq_std": masked_std(seq_w, nonempty, unbiased=True),
        "rollout_is_seq_max": masked_max(seq_w, nonempty, 1.0, any_valid),
        "rollout_is_seq_min": masked_min(seq_w, nonempty, 1.0, any_valid),
        "rollout_is_seq_max_deviation": masked_max((seq_w - 1.0).abs(), nonempty, 0.0, any_valid),
        "rollout_is_seq_fraction_high": masked_mean((seq_w > upper).to(seq_w.dtype), nonempty),
        "rollout_is_seq_fraction_low": masked_mean((seq_w < lower).to(seq_w.dtype), nonempty),
    }


def mismatch_metrics(
    old: torch.Tensor, rollout: torch.Tensor, tokens: ValidTokens
) -> dict[str, torch.Tensor]:
    """KL estimators and perplexity comparison of the training (old) and rollout policies, from
    the compacted log-probs of the valid tokens (`tokens.take`), in float64.

    - mismatch_kl = mean_tok(rollout - old): KL(rollout || training) sampled from the rollout.
    - mismatch_k3_kl = mean_tok(exp(lr) - lr - 1), lr = old - rollout (exponent bounded).
    - *_log_ppl = mean_seq(-mean_tok logp); *_ppl = mean_seq(exp(-mean_tok logp)).
    - log_ppl_diff_i = mean_tok rollout - mean_tok old = log(training_ppl_i / rollout_ppl_i);
      reported as mean, mean |.|, max, min over sequences; ppl_ratio = mean_seq exp(diff_i).
    """
    old, rollout = old.to(F64), rollout.to(F64)  # one conversion of n values, not [B, T]
    per_token = Sample(old, None, tokens.n)  # for its mean over the valid tokens
    lr = old - rollout
    # mean(-lr) as 0 - mean(lr): the same rounding, and 0.0 (not -0.0) when old == rollout
    kl = 0.0 - per_token.mean(lr)
    lr_hi = lr.clamp_(max=METRIC_LOG_BOUND)  # in place: lr is not needed unclamped again
    # k3 saturates above the bound, stays exact below; in place on the fresh exp
    k3 = per_token.mean(torch.exp(lr_hi).sub_(lr_hi).sub_(1.0))
    nonempty, any_valid = tokens.nonempty, tokens.n > 0
    neg_mean_old = -tokens.row_mean(old)
    neg_mean_rollout = -tokens.row_mean(rollout)
    diff = neg_mean_old - neg_mean_rollout

    def seq_mean(x: torch.Tensor, empty: float = 0.0) -> torch.Tensor:
        return masked_mean(x, nonempty, empty=empty)

    def bounded_exp(x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x.clamp(max=METRIC_LOG_BOUND))

    return {
        "mismatch_kl": kl,
        "mismatch_k3_kl": k3,
        "mismatch_training_ppl": seq_mean(bounded_exp(neg_mean_old), empty=1.0),
        "mismatch_training_log_ppl": seq_mean(neg_mean_old),
        "mismatch_rollout_ppl": seq_mean(bounded_exp(neg_mean_rollout), empty=1.0),
        "mismatch_rollout_log_ppl": seq_mean(neg_mean_rollout),
        "mismatch_log_ppl_diff": seq_mean(diff),
        "mismatch_log_ppl_abs_diff": seq_mean(diff.abs()),
        "mismatch_log_ppl_diff_max": masked_max(diff, nonempty, 0.0, any_valid),
        "mismatch_log_ppl_diff_min": masked_min(diff, nonempty, 0.0, any_valid),
        "mismatch_ppl_ratio": seq_mean(bounded_exp(diff), empty=1.0),
    }


def to_floats(stats: dict[str, torch.Tensor], prefix: str = "") -> dict[str, float]:
    """Python floats under `prefix + name`, fetched from the device in one transfer."""
    if not stats:
        return {}
    stacked = torch.stack([v.detach().to(torch.float64).reshape(()) for v in stats.values()])
    return {prefix + k: float(v) for k, v in zip(stats, stacked.cpu().tolist())}

"""Diagnostics of the rollout/training mismatch and of rollout IS weights (pure torch).

Every statistic here is a 0-d float64 tensor; `to_floats` turns a dict of them into python
floats with one device sync. The names are the seed verl PR's (without the `mismatch/` prefix,
which the caller adds).

Invariants:
- Only positions where the mask is true enter a statistic. Masking uses `torch.where`, never
  multiplication, so inf/nan padding under mask 0 cannot leak in.
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

import torch

from asyncrl.algo import agg

# exp(50) ≈ 5e21: far above any meaningful perplexity or k3 value, far below float64 overflow.
METRIC_LOG_BOUND = 50.0
QUANTILES: dict[str, float] = {"p25": 0.25, "p50": 0.50, "p75": 0.75, "p95": 0.95, "p99": 0.99}


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, empty: float = 0.0
) -> torch.Tensor:
    """Mean of `x` where `mask` (bool) is true; `empty` where nothing is valid."""
    mean = agg.masked_mean(x, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return torch.where(count > 0, mean, torch.full_like(mean, empty))


def masked_max(x: torch.Tensor, mask: torch.Tensor, empty: float) -> torch.Tensor:
    """Largest valid entry of `x`; `empty` when nothing is valid."""
    if not bool(mask.any()):
        return torch.tensor(empty, dtype=x.dtype, device=x.device)
    return torch.where(mask, x, torch.full_like(x, -torch.inf)).max()


def masked_min(x: torch.Tensor, mask: torch.Tensor, empty: float) -> torch.Tensor:
    """Smallest valid entry of `x`; `empty` when nothing is valid."""
    return -masked_max(-x, mask, -empty)


def masked_std(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population standard deviation of the valid entries (0 for fewer than two)."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean).square(), mask).sqrt()


def quantiles(values: torch.Tensor, qs: list[float], empty: float) -> torch.Tensor:
    """Linear-interpolation quantiles of a 1-D tensor, as `torch.quantile` computes them.

    Sort-based because `torch.quantile` refuses inputs above 2**24 elements, which a large
    batch of long responses exceeds.
    """
    if values.numel() == 0:
        return torch.full((len(qs),), empty, dtype=values.dtype, device=values.device)
    ordered = values.sort().values
    pos = torch.tensor(qs, dtype=torch.float64, device=values.device) * (values.numel() - 1)
    lo, hi = pos.floor().long(), pos.ceil().long()
    frac = (pos - lo.to(torch.float64)).to(values.dtype)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * frac


def weight_distribution(weights: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean, std, percentiles, max and min of `weights` over valid tokens."""
    w = weights.to(torch.float64)
    stats = {
        "rollout_is_mean": masked_mean(w, valid, empty=1.0),
        "rollout_is_std": masked_std(w, valid),
    }
    # Sorting dominates the cost; the weights' own dtype is exact enough for percentiles.
    qs = quantiles(weights[valid], list(QUANTILES.values()), empty=1.0).to(torch.float64)
    for i, name in enumerate(QUANTILES):
        stats[f"rollout_is_{name}"] = qs[i]
    stats["rollout_is_max"] = masked_max(w, valid, empty=1.0)
    stats["rollout_is_min"] = masked_min(w, valid, empty=1.0)
    return stats


def effective_sample_size(
    weights: torch.Tensor, valid: torch.Tensor, lower: float, upper: float
) -> torch.Tensor:
    """ESS as a fraction in (0, 1]: 1 / mean(w̃²), w̃ = w_c / mean(w_c), w_c = clamp(w, lower, upper).

    Clamping first keeps one huge weight from collapsing the statistic to ~0; w_c >= lower > 0,
    so the normalising mean is never zero when a token is valid.
    """
    clamped = weights.to(torch.float64).clamp(min=lower, max=upper)
    normalised = clamped / masked_mean(clamped, valid, empty=1.0)
    second_moment = masked_mean(normalised.square(), valid, empty=1.0)
    return 1.0 / second_moment


def threshold_fractions(
    log_weights: torch.Tensor, valid: torch.Tensor, lower: float, upper: float
) -> dict[str, torch.Tensor]:
    """Fractions of valid tokens whose true (unclamped, log-space) weight leaves [lower, upper]."""
    lw = log_weights.to(torch.float64).expand_as(valid)
    high = (lw > math.log(upper)).to(torch.float64)
    low = (lw < math.log(lower)).to(torch.float64)
    return {
        "rollout_is_ratio_fraction_high": masked_mean(high, valid),
        "rollout_is_ratio_fraction_low": masked_mean(low, valid),
    }


def sequence_stats(
    weights: torch.Tensor, valid: torch.Tensor, lower: float, upper: float
) -> dict[str, torch.Tensor]:
    """Statistics of the per-sequence mean weight over non-empty sequences.

    At sequence and geometric level the per-sequence mean is the sequence's weight itself.
    """
    seq_w = masked_mean(weights.to(torch.float64), valid, dim=-1, empty=1.0)
    nonempty = valid.any(dim=-1)
    return {
        "rollout_is_seq_mean": masked_mean(seq_w, nonempty, empty=1.0),
        "rollout_is_seq_std": masked_std(seq_w, nonempty),
        "rollout_is_seq_max": masked_max(seq_w, nonempty, empty=1.0),
        "rollout_is_seq_min": masked_min(seq_w, nonempty, empty=1.0),
        "rollout_is_seq_max_deviation": masked_max((seq_w - 1.0).abs(), nonempty, empty=0.0),
        "rollout_is_seq_fraction_high": masked_mean((seq_w > upper).to(seq_w.dtype), nonempty),
        "rollout_is_seq_fraction_low": masked_mean((seq_w < lower).to(seq_w.dtype), nonempty),
    }


def mismatch_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, valid: torch.Tensor
) -> dict[str, torch.Tensor]:
    """KL estimators and perplexity comparison of the training (old) and rollout policies.

    - mismatch_kl = mean_tok(rollout - old): KL(rollout || training) sampled from the rollout.
    - mismatch_k3_kl = mean_tok(exp(lr) - lr - 1), lr = old - rollout (exponent bounded).
    - *_log_ppl = mean_seq(-mean_tok logp); *_ppl = mean_seq(exp(-mean_tok logp)).
    - log_ppl_diff_i = mean_tok rollout - mean_tok old = log(training_ppl_i / rollout_ppl_i);
      reported as mean, mean |.|, max, min over sequences; ppl_ratio = mean_seq exp(diff_i).
    """
    old = old_log_prob.to(torch.float64)
    rollout = rollout_log_prob.to(torch.float64)
    lr = torch.where(valid, old - rollout, torch.zeros((), dtype=torch.float64, device=old.device))
    lr_hi = lr.clamp(max=METRIC_LOG_BOUND)  # k3 saturates above the bound, stays exact below
    nonempty = valid.any(dim=-1)
    neg_mean_old = -masked_mean(old, valid, dim=-1)
    neg_mean_rollout = -masked_mean(rollout, valid, dim=-1)
    diff = neg_mean_old - neg_mean_rollout

    def seq_mean(x: torch.Tensor, empty: float = 0.0) -> torch.Tensor:
        return masked_mean(x, nonempty, empty=empty)

    def bounded_exp(x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x.clamp(max=METRIC_LOG_BOUND))

    return {
        "mismatch_kl": masked_mean(-lr, valid),
        "mismatch_k3_kl": masked_mean(torch.exp(lr_hi) - lr_hi - 1.0, valid),
        "mismatch_training_ppl": seq_mean(bounded_exp(neg_mean_old), empty=1.0),
        "mismatch_training_log_ppl": seq_mean(neg_mean_old),
        "mismatch_rollout_ppl": seq_mean(bounded_exp(neg_mean_rollout), empty=1.0),
        "mismatch_rollout_log_ppl": seq_mean(neg_mean_rollout),
        "mismatch_log_ppl_diff": seq_mean(diff),
        "mismatch_log_ppl_abs_diff": seq_mean(diff.abs()),
        "mismatch_log_ppl_diff_max": masked_max(diff, nonempty, empty=0.0),
        "mismatch_log_ppl_diff_min": masked_min(diff, nonempty, empty=0.0),
        "mismatch_ppl_ratio": seq_mean(bounded_exp(diff), empty=1.0),
    }


def to_floats(stats: dict[str, torch.Tensor], prefix: str = "") -> dict[str, float]:
    """Python floats under `prefix + name`, fetched from the device in one transfer."""
    if not stats:
        return {}
    stacked = torch.stack([v.detach().to(torch.float64).reshape(()) for v in stats.values()])
    return {prefix + k: float(v) for k, v in zip(stats, stacked.cpu().tolist())}

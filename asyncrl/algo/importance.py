"""Rollout importance sampling (IS): correct for the gap between the policy that sampled a
trajectory (the rollout engine: older weights, other kernels) and the training policy.

The seed design (verl's Rollout IS PR), with `lr = old_log_prob - rollout_log_prob`:

- level `token`: w_t = exp(lr_t); `sequence`: w = exp(Σ_t lr_t); `geometric`: w = exp(mean_t lr_t),
  the last two broadcast over the sequence. Every log-weight is clamped to ±SAFETY_LOG_BOUND
  before `exp`, so weights are finite whatever the inputs.
- mode `truncate`: w = min(w, upper); `clip`: w = 0 outside [lower, upper]; lower = 1/upper
  unless given.
- veto: a sequence holding any valid token with lr_t < log(veto_threshold) (the true, unclamped
  per-token ratio) gets weight 0 everywhere; applied after truncate/clip.
- then w = 0 wherever response_mask is 0. Weights are detached; the loss multiplies them in.
- threshold None disables everything: (None, {}). `RolloutIS(apply=False)` is the metrics-only
  mode: full metrics, no weights.

Every setting travels in one `RolloutIS`, validated when it is built (the verl-style flat
`algorithm.rollout_is*` config keys map onto it in `asyncrl.learner.objective`).

Metrics (python floats, prefix `mismatch/`, finite for finite input; conventions for empty
masks in `mismatch_metrics`):
- rollout_is_{mean,std,p25,p50,p75,p95,p99,max,min}: the bounded weights *before*
  truncate/clip/veto, over valid tokens (a sequence weight counts once per valid token), so
  they show the mismatch the mode has to absorb. `rollout_is_std` is the population standard
  deviation of exactly those weights (verl's is of the weights clamped to [lower, upper]).
- rollout_is_eff_sample_size: 1 / mean(w̃²), w̃ = w_c / mean(w_c), w_c = clamp(w, lower, upper);
  a fraction in (0, 1], 1 meaning uniform weights.
- rollout_is_ratio_fraction_{high,low}: valid tokens whose true weight is above upper / below
  lower (computed in log space).
- rollout_is_truncated_fraction: valid tokens capped at upper by truncate (0.0 in clip mode);
  rollout_is_clipped_fraction: valid tokens zeroed by clip (0.0 in truncate mode).
- rollout_is_veto_fraction: non-empty sequences vetoed; rollout_is_catastrophic_token_fraction:
  valid tokens below the veto threshold (both 0.0 when the veto is off).
- rollout_is_seq_{mean,std,max,min,max_deviation,fraction_high,fraction_low}: the per-sequence
  mean weight over non-empty sequences, at every level; `rollout_is_seq_std` is their unbiased
  standard deviation (n - 1, torch's `std` as verl calls it), 0 for fewer than two sequences.
- mismatch_{kl,k3_kl,training_ppl,training_log_ppl,rollout_ppl,rollout_log_ppl,ppl_ratio,
  log_ppl_diff,log_ppl_abs_diff,log_ppl_diff_max,log_ppl_diff_min}: see `mismatch_metrics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asyncrl.algo import mismatch_metrics as mm

SAFETY_LOG_BOUND = 20.0  # exp(20) ≈ 4.85e8: the largest weight ever produced
IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "clip")
OLD_LOG_PROB_MODES = ("bypass", "decoupled")
METRIC_PREFIX = "mismatch/"


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    """Return `value` if it is one of `allowed`, else raise a one-line ValueError."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value  # type: ignore[return-value]


def positive_float(name: str, value: object) -> float:
    """`value` as a finite float > 0, else a one-line ValueError."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number; got {value!r}") from None
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be a positive finite number; got {value!r}")
    return number


def check_same_shape(**tensors: torch.Tensor) -> None:
    """All tensors [batch, seq_len] with one shape, else a one-line ValueError."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        detail = ", ".join(f"{n}={list(s)}" for n, s in shapes.items())
        raise ValueError(f"expected tensors of one shape [batch, seq_len]; got {detail}")


def _bounds(threshold: object, threshold_lower: object) -> tuple[float, float]:
    upper = positive_float("rollout_is_threshold", threshold)
    if threshold_lower is None:
        return upper, 1.0 / upper
    lower = positive_float("rollout_is_threshold_lower", threshold_lower)
    if lower > upper:
        raise ValueError(
            f"rollout_is_threshold_lower ({lower}) must not exceed rollout_is_threshold ({upper})"
        )
    return upper, lower


@dataclass(frozen=True, kw_only=True)
class RolloutIS:
    """The rollout IS settings (verl's `algorithm.rollout_is*` keys), checked when built: a bad
    setting raises the same one-line ValueError the weights would, before any tensor is seen.

    Defaults are the library's, not the config's: `threshold` None means IS is off.
    """

    apply: bool = True
    """Multiply the weights into the loss (config `rollout_is`); False: metrics only."""
    level: str = "token"
    """Ratio aggregation, one of IS_LEVELS: per token, sequence product, geometric mean."""
    mode: str = "truncate"
    """One of IS_MODES: truncate caps at `threshold`; clip zeroes outside [lower, upper]."""
    threshold: float | None = None
    """Upper weight bound; None disables rollout IS entirely (no weights, no metrics)."""
    threshold_lower: float | None = None
    """Lower weight bound (clip mode, and the low-side metrics); None is 1 / threshold."""
    veto_threshold: float | None = 1e-4
    """A valid token whose true ratio is below this zeroes its sequence; None: no veto."""

    def __post_init__(self) -> None:
        """What the config validation checks too: the bounds only when IS is on."""
        if not isinstance(self.apply, bool):
            raise ValueError(f"rollout_is must be true or false; got {self.apply!r}")
        check_choice("rollout_is_level", self.level, IS_LEVELS)
        check_choice("rollout_is_mode", self.mode, IS_MODES)
        if self.threshold is not None:
            _bounds(self.threshold, self.threshold_lower)
        if self.veto_threshold is not None:
            positive_float("rollout_is_veto_threshold", self.veto_threshold)

    @property
    def enabled(self) -> bool:
        """Whether weights and metrics are computed at all (`threshold` is set)."""
        return self.threshold is not None

    def bounds(self) -> tuple[float, float]:
        """(upper, lower) as floats, lower defaulting to 1 / upper; IS must be enabled."""
        return _bounds(self.threshold, self.threshold_lower)


def log_ratio(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """old - rollout in at least float32, 0 under the mask (padding values never leak in)."""
    dtype = torch.promote_types(old_log_prob.dtype, torch.float32)
    diff = old_log_prob.to(dtype) - rollout_log_prob.to(dtype)
    return torch.where(valid, diff, torch.zeros((), dtype=dtype, device=diff.device))


def _log_weights(lr: torch.Tensor, tokens: mm.ValidTokens, level: str) -> torch.Tensor:
    """Unclamped log-weights: [batch, seq_len] at token level, [batch, 1] at the sequence
    levels (broadcast only at the end, so clamp, exp and bounds run once per sequence)."""
    if level == "token":
        return lr
    per_seq = lr.sum(dim=-1, keepdim=True)  # lr is already 0 under the mask
    if level == "sequence":
        return per_seq
    # geometric: the masked mean, as `agg.masked_mean` divides it (an empty row gets 0 / 1)
    return per_seq / tokens.counts.to(lr.dtype).clamp(min=1).unsqueeze(-1)


def _bound_weights(raw: torch.Tensor, mode: str, lower: float, upper: float) -> torch.Tensor:
    """Apply truncate (cap at upper) or clip (zero outside [lower, upper])."""
    if mode == "truncate":
        return raw.clamp(max=upper)
    return torch.where((raw < lower) | (raw > upper), torch.zeros_like(raw), raw)


def _mode_stats(raw: mm.Sample, mode: str, lower: float, upper: float) -> dict[str, torch.Tensor]:
    """The fraction of valid tokens truncate or clip changed (the other one reports 0)."""
    v = raw.values  # compared in the weights' own dtype, exactly as `_bound_weights` does
    changed = v > upper if mode == "truncate" else (v < lower) | (v > upper)
    fraction = raw.fraction(changed)
    zero = torch.zeros_like(fraction)
    return {
        "rollout_is_truncated_fraction": fraction if mode == "truncate" else zero,
        "rollout_is_clipped_fraction": fraction if mode == "clip" else zero,
    }


def _veto(
    lr: torch.Tensor, valid: torch.Tensor, tokens: mm.ValidTokens, veto_threshold: object
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bool [batch] of vetoed sequences, with the veto and catastrophic-token fractions."""
    zero = torch.zeros((), dtype=torch.float64, device=lr.device)
    if veto_threshold is None:
        vetoed = torch.zeros(valid.shape[:1], dtype=torch.bool, device=valid.device)
        stats = {"rollout_is_veto_fraction": zero, "rollout_is_catastrophic_token_fraction": zero}
        return vetoed, stats
    log_veto = math.log(positive_float("rollout_is_veto_threshold", veto_threshold))
    catastrophic = valid & (lr < log_veto)  # the true per-token ratio, before any clamp
    vetoed = catastrophic.any(dim=-1)
    # Integer counts (count_nonzero) give the same fractions as float64 means of 0/1 flags.
    nonempty = tokens.nonempty.count_nonzero().clamp(min=1).to(torch.float64)
    caught = catastrophic.count_nonzero().to(torch.float64)
    return vetoed, {
        "rollout_is_veto_fraction": vetoed.count_nonzero().to(torch.float64) / nonempty,
        "rollout_is_catastrophic_token_fraction": caught / tokens.n if tokens.n else zero,
    }


def _samples(
    lr: torch.Tensor, log_w: torch.Tensor, raw: torch.Tensor, tokens: mm.ValidTokens, level: str
) -> tuple[mm.Sample, mm.Sample, torch.Tensor]:
    """The log-weights and weights as samples over the valid tokens, and the per-sequence mean
    weight (float64 [batch], 1.0 for an empty row) that the sequence statistics describe."""
    if level == "token":
        raw_s = mm.Sample(tokens.take(raw), None, tokens.n)
        seq_w = tokens.row_mean(raw_s.f64, empty=1.0)
        return mm.Sample(tokens.take(lr), None, tokens.n), raw_s, seq_w
    # One value per sequence, counted once per valid token: no [batch, seq_len] copy is needed,
    # and a sequence's mean weight is its weight.
    log_s = mm.Sample(log_w.squeeze(-1), tokens.counts, tokens.n)
    raw_s = mm.Sample(raw.squeeze(-1), tokens.counts, tokens.n)
    return log_s, raw_s, torch.where(tokens.nonempty, raw_s.values.to(torch.float64), 1.0)


def compute_rollout_importance_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    settings: RolloutIS,
    metrics: bool = True,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Rollout IS weights [batch, seq_len] (detached) and `mismatch/` metrics; see the module doc.

    `settings.threshold` None returns (None, {}); `settings.apply` is not read here (see
    `apply_rollout_is`). Nonzero `response_mask` entries are valid. Weights come back in
    float32 (float64 if the log-probs are float64). The weights are built on the padded matrix;
    every metric runs on the valid tokens, compacted once. `metrics` False: the weights alone
    (the same ones) and no metrics — for a caller that reports them from another call.
    """
    if not settings.enabled:
        return None, {}
    upper, lower = settings.bounds()
    level, mode = settings.level, settings.mode
    check_same_shape(
        old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask
    )
    with torch.no_grad():
        valid = response_mask.bool()
        tokens = mm.ValidTokens.of(valid)
        lr = log_ratio(old_log_prob, rollout_log_prob, valid)
        log_w = _log_weights(lr, tokens, level)
        raw = log_w.clamp(min=-SAFETY_LOG_BOUND, max=SAFETY_LOG_BOUND).exp_()  # one buffer
        vetoed, veto_stats = _veto(lr, valid, tokens, settings.veto_threshold)
        keep = valid & ~vetoed.unsqueeze(-1)
        bounded = _bound_weights(raw, mode, lower, upper)  # broadcast here if [B, 1]
        weights = torch.where(keep, bounded, torch.zeros((), dtype=raw.dtype, device=raw.device))
        if not metrics:
            return weights.detach(), {}
        log_s, raw_s, seq_w = _samples(lr, log_w, raw, tokens, level)
        stats = {
            **mm.weight_distribution(raw_s),
            "rollout_is_eff_sample_size": mm.effective_sample_size(raw_s, lower, upper),
            **mm.threshold_fractions(log_s, lower, upper),
            **_mode_stats(raw_s, mode, lower, upper),
            **veto_stats,
            **mm.sequence_stats(seq_w, tokens, lower, upper),
            **mm.mismatch_metrics(tokens.take(old_log_prob), tokens.take(rollout_log_prob), tokens),
        }
    return weights.detach(), mm.to_floats(stats, METRIC_PREFIX)


def apply_rollout_is(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    settings: RolloutIS,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """verl's two switches in one call: `settings.threshold` None → (None, {});
    `settings.apply` False → metrics only (None, metrics); otherwise (weights, metrics)."""
    weights, metrics = compute_rollout_importance_weights(
        old_log_prob, rollout_log_prob, response_mask, settings
    )
    return (weights if settings.apply else None), metrics


def normalize_weights_to_batch_mean(
    weights: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """Rescale `weights` to batch mean 1 (verl's `rollout_is_batch_normalize`); 0 under the mask.

    The mean is taken over the units the weights belong to (verl's rollout_corr_math.md:
    w̃ = w / E[w] at each aggregation level): at `token` level over the valid tokens; at
    `sequence` and `geometric` level over the sequences with at least one valid token, each
    counted once with its weight (the mean of its valid tokens' weights, all equal unless
    vetoed or clipped to 0), so a long sequence weighs no more than a short one.

    If that mean is zero (everything clipped or vetoed) there is nothing to rescale: the masked
    weights come back unchanged rather than divided by zero.
    """
    check_same_shape(weights=weights, mask=mask)
    check_choice("rollout_is_level", level, IS_LEVELS)
    valid = mask.bool()
    kept = torch.where(valid, weights, torch.zeros_like(weights))
    if level == "token":
        total, count = kept.sum(), valid.sum().to(kept.dtype)
    else:
        per_row = valid.sum(dim=-1).to(kept.dtype)
        nonempty = per_row > 0
        seq_w = kept.sum(dim=-1) / per_row.clamp(min=1)
        total, count = seq_w[nonempty].sum(), nonempty.sum().to(kept.dtype)
    scale = torch.where(total > 0, count / torch.where(total > 0, total, 1.0), 1.0)
    return kept * scale


def select_old_log_prob(
    mode: str, rollout_log_prob: torch.Tensor, recomputed_log_prob: torch.Tensor | None = None
) -> torch.Tensor:
    """The log-probs that play the old (proximal) policy.

    `bypass`: the rollout engine's own log-probs; no recompute is needed and rollout IS weights
    become exactly 1 (the mismatch is then absorbed by the PPO ratio instead). `decoupled`: the
    learner's recomputed log-probs, required.
    """
    check_choice("old_log_prob mode", mode, OLD_LOG_PROB_MODES)
    if mode == "bypass":
        return rollout_log_prob
    if recomputed_log_prob is None:
        raise ValueError("decoupled mode needs recomputed_log_prob (the learner's recompute)")
    check_same_shape(rollout_log_prob=rollout_log_prob, recomputed_log_prob=recomputed_log_prob)
    return recomputed_log_prob


def lag_sums(
    weights: torch.Tensor, mask: torch.Tensor, lags: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """[L + 1, 3] float64 on the CPU: for each lag 0..L (L the largest lag holding a unit) the
    Σw, Σw² and count of its units' IS weights; what `ess_by_lag` reads, and what shards of
    one batch add up (a sum, so ranks can all-reduce it).

    The units are the ones the weights belong to: at `token` level the valid tokens of the
    lag's rows; at `sequence` and `geometric` level the lag's rows with a valid token, each
    once with its weight (the mean of its valid tokens' weights, all equal unless vetoed), so
    a long sequence does not count as many samples. `lags` [B]: each row's staleness, >= 0.
    """
    check_same_shape(weights=weights, mask=mask)
    check_choice("rollout_is_level", level, IS_LEVELS)
    check_lags(lags, weights.shape[0])
    valid = mask.bool()
    kept = torch.where(valid, weights.detach().to(torch.float64), 0.0)
    if level == "token":
        unit_w, unit_lag = kept[valid], lags.unsqueeze(-1).expand_as(valid)[valid]
    else:
        counts = valid.sum(dim=-1)
        rows = counts > 0
        unit_w, unit_lag = (kept.sum(dim=-1) / counts.clamp(min=1))[rows], lags[rows]
    unit_w, unit_lag = unit_w.cpu(), unit_lag.cpu().to(torch.int64)
    size = int(unit_lag.max()) + 1 if unit_lag.numel() else 0
    columns = torch.stack((unit_w, unit_w.square(), torch.ones_like(unit_w)), dim=-1)
    return torch.zeros(size, 3, dtype=torch.float64).index_add_(0, unit_lag, columns)


def check_lags(lags: torch.Tensor, rows: int) -> None:
    """One staleness per row, none negative (ValueError in one line otherwise)."""
    if tuple(lags.shape) != (rows,):
        raise ValueError(
            f"lags must hold one staleness per row: got {list(lags.shape)} for {rows} rows"
        )
    if lags.numel() and int(lags.min()) < 0:
        raise ValueError(f"lags must be >= 0 (a row newer than the learner?); got {lags.tolist()}")


def kl_lag_sums(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, lags: torch.Tensor
) -> torch.Tensor:
    """[L + 1, 2] float64 on the CPU: for each lag 0..L (L the largest lag holding a valid
    token) the Σ over its rows' valid tokens of the k3 estimate of KL(rollout || old),
    exp(lr) - lr - 1 with lr = old - rollout (the exponent bounded as `mismatch_k3_kl`'s), and
    their count; a sum, so shards of one batch add up. Per token k3 is >= 0 and 0 exactly where
    the two policies agree; its mean over a lag's tokens is how far the policy has moved from
    the one that generated that lag's tokens (plus the engine's numerical mismatch)."""
    check_same_shape(old=old, rollout=rollout, mask=mask)
    check_lags(lags, old.shape[0])
    valid = mask.bool()
    lr = (old.detach().to(torch.float64) - rollout.detach().to(torch.float64))[valid]
    lr = lr.clamp(max=mm.METRIC_LOG_BOUND)
    k3 = (torch.exp(lr) - lr - 1.0).cpu()
    unit_lag = lags.unsqueeze(-1).expand_as(valid)[valid].cpu().to(torch.int64)
    size = int(unit_lag.max()) + 1 if unit_lag.numel() else 0
    columns = torch.stack((k3, torch.ones_like(k3)), dim=-1)
    return torch.zeros(size, 2, dtype=torch.float64).index_add_(0, unit_lag, columns)


def kl_from_lag_sums(sums: torch.Tensor) -> dict[int, float]:
    """{lag: mean per-token k3 KL} from `kl_lag_sums`' rows; lags without a token left out."""
    return {lag: total / n for lag, (total, n) in enumerate(sums.tolist()) if n > 0}


def ess_from_lag_sums(sums: torch.Tensor) -> dict[int, tuple[float, int]]:
    """{lag: (normalised ESS, n)} from `lag_sums`' rows; lags without a unit are left out.

    The normalised effective sample size of n weights is (Σw)² / (n·Σw²): 1 when they are all
    equal, 1/n when one carries everything, 0 when all are 0 (every unit vetoed or clipped:
    nothing effective is left)."""
    out: dict[int, tuple[float, int]] = {}
    for lag, (total, squares, n) in enumerate(sums.tolist()):
        if n > 0:
            out[lag] = (total * total / (n * squares) if squares > 0 else 0.0, round(n))
    return out


def ess_by_lag(
    weights: torch.Tensor, mask: torch.Tensor, lags: torch.Tensor, level: str = "token"
) -> dict[int, tuple[float, int]]:
    """{lag: (normalised ESS, n)} of the IS weights, split by each row's staleness `lags` [B]
    (units and sums: `lag_sums`; the ESS: `ess_from_lag_sums`)."""
    return ess_from_lag_sums(lag_sums(weights, mask, lags, level))

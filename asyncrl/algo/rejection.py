"""Rollout rejection sampling (RS): the later verl design that separates rejecting tokens or
sequences from weighting them.

With lr = old_log_prob - rollout_log_prob (clamped to ±SAFETY_LOG_BOUND) the divergences are
k1 = -lr, k2 = lr²/2, k3 = exp(lr) - 1 - lr. A criterion names one statistic and bounds it:

- `token_k1|k2|k3`: per token; a token outside the bounds is rejected.
- `seq_sum_k*` / `seq_mean_k*` (geometric) / `seq_max_k2|k3`: over a sequence's valid tokens;
  a sequence outside the bounds is rejected whole (`seq_max_k*` succeeds the seed's veto).

Bounds are inclusive; None leaves that side open. Every criterion is evaluated on the input
mask and the survivors are ANDed, so the result does not depend on the order of criteria.
The input mask is never modified; a new one (same dtype) comes back.

Metrics (python floats, prefix `rejection/`): `<name>_fraction` is the fraction of valid tokens
(token criteria) or non-empty sequences (sequence criteria) that criterion rejects on its own;
`masked_token_fraction` is the fraction of valid tokens the combined result removes and
`masked_seq_fraction` the fraction of non-empty sequences left with no valid token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncrl.algo import mismatch_metrics as mm
from asyncrl.algo.importance import SAFETY_LOG_BOUND, check_choice, check_same_shape, log_ratio

RS_CRITERIA = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
METRIC_PREFIX = "rejection/"


@dataclass(frozen=True)
class RejectionCriterion:
    """Keep a token/sequence iff lower <= statistic <= upper (None: that side unbounded)."""

    name: str
    lower: float | None = None
    upper: float | None = None

    def __post_init__(self) -> None:
        check_choice("rejection criterion", self.name, RS_CRITERIA)
        for side in ("lower", "upper"):
            value = getattr(self, side)
            if value is not None and (isinstance(value, bool) or not _is_real(value)):
                raise ValueError(f"{self.name} {side} bound must be a number; got {value!r}")
        if self.lower is None and self.upper is None:
            raise ValueError(f"{self.name} needs a lower or an upper bound; got neither")
        if self.lower is not None and self.upper is not None and self.lower > self.upper:
            raise ValueError(f"{self.name} lower bound {self.lower} exceeds upper {self.upper}")


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not math.isnan(value)


def _as_criterion(item: object) -> RejectionCriterion:
    """A RejectionCriterion from itself, a (name, lower, upper) triple, or any object with
    those attributes (the config schema's own criterion record)."""
    if isinstance(item, RejectionCriterion):
        return item
    if all(hasattr(item, a) for a in ("name", "lower", "upper")):
        return RejectionCriterion(item.name, item.lower, item.upper)  # type: ignore[attr-defined]
    if isinstance(item, str) or not isinstance(item, Sequence) or len(item) != 3:
        raise ValueError(f"a rejection criterion is (name, lower, upper); got {item!r}")
    name, lower, upper = item
    return RejectionCriterion(name, lower, upper)  # type: ignore[arg-type]


def divergence(lr: torch.Tensor, kind: str) -> torch.Tensor:
    """k1, k2 or k3 of a log ratio lr = log(π_old / π_rollout), elementwise (a new tensor)."""
    if kind == "k1":
        return -lr
    if kind == "k2":
        return lr.square().mul_(0.5)  # in place on the fresh square: one [B, T] buffer, not two
    return torch.expm1(lr).sub_(lr)  # k3 = exp(lr) - 1 - lr, expm1 is exact near 0


class _Batch:
    """What every criterion reads, computed once: the clamped log ratio (0 under the mask, so
    each divergence is 0 there and row reductions need no re-masking), the divergences asked
    for so far (criteria sharing a kind share one), and the per-row counts when needed."""

    def __init__(self, lr: torch.Tensor, valid: torch.Tensor) -> None:
        self.lr, self.valid = lr, valid
        self._k: dict[str, torch.Tensor] = {}
        self._counts: torch.Tensor | None = None

    def k(self, kind: str) -> torch.Tensor:
        if kind not in self._k:
            self._k[kind] = divergence(self.lr, kind)
        return self._k[kind]

    def counts(self) -> torch.Tensor:
        """Valid tokens per row, as a divisor in the log ratio's dtype (an empty row gets 1,
        its sum being 0): the same division `agg.masked_mean` does."""
        if self._counts is None:
            self._counts = self.valid.sum(dim=-1).clamp(min=1).to(self.lr.dtype)
        return self._counts


def _statistic(batch: _Batch, name: str) -> torch.Tensor:
    """The criterion's statistic: [batch, seq_len] for token criteria, [batch] for sequences.

    k is exactly 0 at padded positions, so plain row sums and maxima equal the masked ones."""
    scope, kind = name.rsplit("_", 1)
    k = batch.k(kind)
    if scope == "token":
        return k
    if scope == "seq_sum":
        return k.sum(dim=-1)
    if scope == "seq_mean":
        return k.sum(dim=-1) / batch.counts()
    # seq_max: an empty row gets 0 (k2, k3 >= 0); it holds no valid token to reject anyway.
    return k.amax(dim=-1)


def _outside(stat: torch.Tensor, criterion: RejectionCriterion) -> torch.Tensor:
    """Bool mask of the statistic outside [lower, upper] (NaN is never outside)."""
    rejected = None if criterion.lower is None else stat < criterion.lower
    if criterion.upper is not None:
        high = stat > criterion.upper
        rejected = high if rejected is None else rejected.logical_or_(high)
    assert rejected is not None  # RejectionCriterion insists on a bound
    return rejected


def rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    criteria: Sequence[RejectionCriterion | tuple[str, float | None, float | None]],
) -> tuple[torch.Tensor, dict[str, float]]:
    """A new response mask with every rejected token/sequence zeroed, and `rejection/` metrics.

    `criteria` items: RejectionCriterion, (name, lower, upper), or any record with `name`,
    `lower`, `upper` attributes (e.g. `algorithm.rollout_rs` entries)."""
    parsed = [_as_criterion(c) for c in criteria]
    names = [c.name for c in parsed]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"rejection criteria repeat {', '.join(duplicates)}; give each once")
    check_same_shape(
        old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask
    )
    with torch.no_grad():
        valid = response_mask.bool()
        nonempty = valid.any(dim=-1)
        n_valid, n_rows = _count(valid), _count(nonempty)
        # divisors: an empty batch has nothing to reject, so its fractions are 0 / 1 = 0
        per_token, per_row = n_valid.clamp(min=1), n_rows.clamp(min=1)
        lr = log_ratio(old_log_prob, rollout_log_prob, valid)
        batch = _Batch(lr.clamp_(min=-SAFETY_LOG_BOUND, max=SAFETY_LOG_BOUND), valid)
        keep = valid.clone()
        stats: dict[str, torch.Tensor] = {}
        for criterion in parsed:
            rejected = _outside(_statistic(batch, criterion.name), criterion)
            over, total = (nonempty, per_row) if rejected.dim() == 1 else (valid, per_token)
            # counted among valid tokens / non-empty rows only: padding may fail a bound too
            stats[f"{criterion.name}_fraction"] = _count(rejected & over) / total
            rejected = rejected.unsqueeze(-1) if rejected.dim() == 1 else rejected
            keep.logical_and_(rejected.logical_not_())  # a sequence criterion drops the row
        # keep is a subset of valid: what it lost is the difference of two exact counts
        stats["masked_token_fraction"] = (n_valid - _count(keep)) / per_token
        stats["masked_seq_fraction"] = (n_rows - _count(keep.any(dim=-1))) / per_row
        zero = torch.zeros((), dtype=response_mask.dtype, device=response_mask.device)
        new_mask = torch.where(keep, response_mask, zero)
    return new_mask, mm.to_floats(stats, METRIC_PREFIX)


def _count(flags: torch.Tensor) -> torch.Tensor:
    """Number of set flags as a float64 0-d tensor (exact; no device sync)."""
    return flags.count_nonzero().to(torch.float64)

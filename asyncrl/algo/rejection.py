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

from asyncrl.algo import agg
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
    """k1, k2 or k3 of a log ratio lr = log(π_old / π_rollout), elementwise."""
    if kind == "k1":
        return -lr
    if kind == "k2":
        return 0.5 * lr.square()
    return torch.expm1(lr) - lr  # k3 = exp(lr) - 1 - lr, expm1 is exact near 0


def _statistic(lr: torch.Tensor, valid: torch.Tensor, name: str) -> torch.Tensor:
    """The criterion's statistic: [batch, seq_len] for token criteria, [batch] for sequences."""
    scope, kind = name.rsplit("_", 1)
    k = divergence(lr, kind)
    if scope == "token":
        return k
    if scope == "seq_sum":
        return agg.masked_sum(k, valid, dim=-1)
    if scope == "seq_mean":
        return mm.masked_mean(k, valid, dim=-1)
    # seq_max: an empty row gets 0 (k2, k3 >= 0); it holds no valid token to reject anyway.
    return torch.where(valid, k, torch.zeros_like(k)).amax(dim=-1)


def _outside(stat: torch.Tensor, criterion: RejectionCriterion) -> torch.Tensor:
    rejected = torch.zeros_like(stat, dtype=torch.bool)
    if criterion.lower is not None:
        rejected |= stat < criterion.lower
    if criterion.upper is not None:
        rejected |= stat > criterion.upper
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
        lr = log_ratio(old_log_prob, rollout_log_prob, valid)
        lr = lr.clamp(min=-SAFETY_LOG_BOUND, max=SAFETY_LOG_BOUND)
        keep = valid.clone()
        stats: dict[str, torch.Tensor] = {}
        for criterion in parsed:
            rejected = _outside(_statistic(lr, valid, criterion.name), criterion)
            if rejected.dim() == 1:  # a sequence criterion rejects the whole row
                stats[f"{criterion.name}_fraction"] = _fraction(rejected, nonempty)
                keep &= ~rejected.unsqueeze(-1)
            else:
                stats[f"{criterion.name}_fraction"] = _fraction(rejected, valid)
                keep &= ~rejected
        stats["masked_token_fraction"] = _fraction(~keep, valid)
        stats["masked_seq_fraction"] = _fraction(~keep.any(dim=-1), nonempty)
        new_mask = torch.where(keep, response_mask, torch.zeros_like(response_mask))
    return new_mask, mm.to_floats(stats, METRIC_PREFIX)


def _fraction(flags: torch.Tensor, over: torch.Tensor) -> torch.Tensor:
    return mm.masked_mean(flags.to(torch.float64), over)

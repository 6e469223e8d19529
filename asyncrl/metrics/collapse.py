"""Signs that the policy is collapsing, computed every step and watched over the run.

A policy that falls into one degenerate answer (every turn an immediate EOS, one constant
guess) stops learning for good: every group's rewards are identical, so group advantages are 0
and so is the gradient. Its signature is visible before the reward curve says anything: the
policy entropy falls to a small fraction of its start, the trained responses all have one
length, and steps with no learning signal (every advantage 0) follow one another.

`length_metrics(groups)` gives the response-length distribution of a trained batch
(p10/p50/p90); the loop adds it to the step's metrics. `CollapseWatch.update(metrics)`, fed each
step's metrics, returns one warning line when a collapse sign has lasted `patience` steps (once
per collapse: it re-arms when the sign clears), naming the likely causes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ENTROPY = "actor/entropy"
LENGTH_KEYS = {
    10: "rollout/response_length_p10",
    50: "rollout/response_length_p50",
    90: "rollout/response_length_p90",
}
ADV_MAX, ADV_MIN = "learner/adv_max", "learner/adv_min"

ENTROPY_CAUSES = (
    "likely causes: a learning rate too high for the model "
    "(actor_train.training_args.learning_rate), no entropy regularisation (actor.entropy_coeff), "
    "too few samples per group (num_return_sequences_in_group)"
)
LENGTH_CAUSES = (
    "the policy answers one fixed way (an immediate EOS, one constant answer); likely causes: "
    "a prompt idiom the warm-start model does not answer in the task's format, invalid or empty "
    "answers scored like wrong ones (no gradient away from them), a learning rate too high"
)
SIGNAL_CAUSES = (
    "every group's rewards are identical, so the policy does not learn; likely causes: a reward "
    "too sparse for the warm-start model, a collapsed policy (see entropy and lengths)"
)


def length_metrics(groups: Sequence[Any]) -> dict[str, float]:
    """p10/p50/p90 of the response lengths (tokens) of the trained batch `groups` (anything with
    a `response_lengths` array, as `TrajectoryGroup`); empty for an empty batch."""
    parts = [np.asarray(g.response_lengths, dtype=np.float64).ravel() for g in groups]
    lengths = np.concatenate(parts) if parts else np.zeros(0)
    if lengths.size == 0:
        return {}
    values = np.percentile(lengths, list(LENGTH_KEYS))
    return {key: float(v) for key, v in zip(LENGTH_KEYS.values(), values, strict=True)}


@dataclass
class _Streak:
    """Consecutive steps a sign has held; `fired` keeps one warning per collapse."""

    steps: int = 0
    fired: bool = False

    def see(self, holds: bool, patience: int) -> bool:
        """Count this step; True exactly when the sign has just held `patience` steps."""
        if not holds:
            self.steps, self.fired = 0, False
            return False
        self.steps += 1
        if self.steps >= patience and not self.fired:
            self.fired = True
            return True
        return False


@dataclass
class CollapseWatch:
    """Warns when entropy or the response-length distribution collapses, or learning stalls."""

    entropy_fraction: float = 0.1
    """Entropy below this fraction of its start counts as collapsed."""
    patience: int = 5
    """Consecutive steps a sign must hold before the warning (one noisy step is not a trend)."""
    baseline_steps: int = 3
    """The entropy's start is the mean of its first this many values."""
    _start: list[float] = field(default_factory=list)
    _entropy: _Streak = field(default_factory=_Streak)
    _length: _Streak = field(default_factory=_Streak)
    _signal: _Streak = field(default_factory=_Streak)
    _last_length: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.entropy_fraction < 1.0:
            raise ValueError(f"CollapseWatch.entropy_fraction must be in (0, 1), got "
                             f"{self.entropy_fraction}")  # fmt: skip
        if self.patience < 1 or self.baseline_steps < 1:
            raise ValueError("CollapseWatch.patience and baseline_steps must be >= 1")

    @property
    def entropy_start(self) -> float | None:
        """The entropy's starting level, once `baseline_steps` values were seen."""
        if len(self._start) < self.baseline_steps:
            return None
        return sum(self._start) / len(self._start)

    def update(self, metrics: Mapping[str, float]) -> str | None:
        """Feed one step's metrics; a warning line when a collapse sign has just lasted
        `patience` steps, else None. Missing keys leave their sign's count as it was."""
        lines = [self._check_entropy(metrics), self._check_length(metrics)]
        lines.append(self._check_signal(metrics))
        found = [line for line in lines if line]
        return "collapse warning: " + " | ".join(found) if found else None

    def _check_entropy(self, metrics: Mapping[str, float]) -> str | None:
        value = _finite(metrics.get(ENTROPY))
        if value is None:
            return None
        start = self.entropy_start
        if start is None:
            self._start.append(value)
            return None
        if not self._entropy.see(value < self.entropy_fraction * start, self.patience):
            return None
        return (f"policy entropy {value:.3g} is below {self.entropy_fraction:g} of its start "
                f"({start:.3g}) for {self.patience} steps; {ENTROPY_CAUSES}")  # fmt: skip

    def _check_length(self, metrics: Mapping[str, float]) -> str | None:
        p10, p50, p90 = (_finite(metrics.get(k)) for k in LENGTH_KEYS.values())
        if p10 is None or p50 is None or p90 is None:
            return None
        # One value for most of the batch, and the same value as the step before.
        holds = p10 == p90 and (self._last_length is None or p50 == self._last_length)
        self._last_length = p50
        if not self._length.see(holds, self.patience):
            return None
        return (f"the trained responses are {p50:g} tokens long (p10 = p90) for {self.patience} "
                f"steps: {LENGTH_CAUSES}")  # fmt: skip

    def _check_signal(self, metrics: Mapping[str, float]) -> str | None:
        hi, lo = _finite(metrics.get(ADV_MAX)), _finite(metrics.get(ADV_MIN))
        if hi is None or lo is None:
            return None
        if not self._signal.see(hi == 0.0 and lo == 0.0, self.patience):
            return None
        return f"every advantage was 0 for {self.patience} steps: {SIGNAL_CAUSES}"


def _finite(value: Any) -> float | None:
    """`value` as a finite float, or None (absent, not a number, NaN or infinite)."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None

"""The adaptive staleness bound (`async.max_staleness: auto`): a small controller that moves
the bound between 0 and `max_staleness_hard` from what the learner measured on trained groups.

**The signal** is a normalised effective sample size by staleness (`learner/lag_metrics.py`),
read for the lags `1 .. bound` the bound admits (lag 0's mismatch is numerical, which no bound
changes; lags past the bound are stragglers the stale policy admitted earlier)
that hold at least `min_units` units. Which ESS (`signal`):

- `sequence` (the default): `is/seq_ess_by_lag/<k>` over `is/seq_units_by_lag/<k>` rows, the
  ESS of the lag's *untruncated sequence-level* ratios π_learner(y|x) / π_behaviour(y|x)
  (`algo/lag_stats.py`). It measures the shift itself, whatever the loss does about it: it is
  Kong's effective sample size of the trajectory distribution the lag was drawn from, for an
  estimate under the policy being trained, so a target of 0.7 reads "a lag's groups must be
  worth at least 70 % of on-policy ones" (an unbiased estimate from them has at most 1/0.7
  the variance); the same target means the same at every `rollout_is_level`. Its limit: it grows
  stricter with the response length (the log-ratio's variance adds up over tokens); the
  numerical part of that is the floor below.
- `weights`: `is/ess_by_lag/<k>` over `is/units_by_lag/<k>` units, the ESS of the IS weights
  the loss applies (tokens or sequences per `algorithm.rollout_is_level`): how much of a lag
  the correction keeps. Truncated, clipped and geometric-mean weights are built to hide the
  shift, so this ESS stays near 1 long after the policy has moved (`asyncrl bench premise`,
  geometric IS truncated at 2: 0.97-0.99 at lag 4).

The sequence ESS is the default because it is the one of the two that measures the shift, and
its target has one meaning at every IS level; the 0.7 default is that meaning (variance at
most 1/0.7 of on-policy), not a value fitted to a workload. What neither sees: a cost of
staleness that is not variance. On `asyncrl bench premise` the sequence ratios' ESS at lag 4
is 0.4-0.95 per step, 0.90-0.93 over a run (10 % more variance), yet bound 4 trains about 2
points under bound 2 over 6 seeds: the loss there (geometric weights truncated at 2) does not
apply the sequence ratios, so what it leaves uncorrected is a bias, which a target on the
variance does not bound (`target_kl` is the knob for that). Read as a bound on that bias,
the same ESS asks more: the reweighting left undone has a relative size up to sqrt(χ²),
χ² = 1/ESS - 1, and keeping it within the standard error of an n-row batch's mean asks
ESS >= n/(n+1); `asyncrl bench premise`'s `auto_bias` (0.985, n = 64) trains like bound 1,
within a point of the best fixed bound over 6 seeds (one workload: not yet a default).

**The numerical floor.** Lag 0's ESS is what no bound changes: the engine's and the learner's
numerics differ (bf16 kernels, another attention), and over long responses that alone can
pull the sequence ratios' ESS far under any target. The controller keeps the mean lag-0 ESS
it has measured (over steps with at least `min_units` lag-0 units; 1 before any) and reads
each lag's ESS relative to it, min(1, ESS_k / floor): for a log-normal ratio the ESS is
exp(-σ²), and if the numerical and the staleness parts of the log-ratio are independent their
variances add, so the ratio is the ESS of the staleness's own part (an approximation: the
floor is a mean over the rows and lengths lag 0 had). Lag-0 rows are common at the start of a run (bound 1, the first
batches); a CPU run with the learner's own numerics in the engine has a floor of exactly 1.

With a KL target (`target_kl`), each lag's mean per-token k3 KL between the behaviour and the
learner's policy, `is/kl_by_lag/<k>`, is read too. A lag breaks the target when its ESS is
below `target_ess` or its KL above `target_kl`. Then:

- **tighten at once**: after `tighten_after` consecutive steps in which some lag broke the
  target, the bound drops below the lowest such lag (at least by one);
- **relax by one**: after `relax_wait` consecutive steps with no lag off target (a step with
  no stale group measured counts as healthy: at bound 0 nothing is stale), the bound rises by
  one, up to `hard`;
- **back off** (hysteresis): a relaxed bound that breaks the target again before the next
  relax doubles the wait before the next try (up to `relax_after · max_backoff`); a relax that
  holds resets it to `relax_after`. So a policy that cannot afford a looser bound is probed
  ever more rarely, and the steps spent below target stay bounded.

Every change comes back as a `Decision` with its reason (the loop logs it in one line and the
`replay/staleness_*` metrics record it); `state_dict` / `load_state_dict` carry the whole state
across a resume. Pure Python: no Ray, no torch, no config import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The learner's per-lag metric names (`learner/lag_metrics.py`).
ESS_PREFIX, UNITS_PREFIX, KL_PREFIX = "is/ess_by_lag/", "is/units_by_lag/", "is/kl_by_lag/"
SEQ_ESS_PREFIX, SEQ_UNITS_PREFIX = "is/seq_ess_by_lag/", "is/seq_units_by_lag/"
#: signal -> (the ESS metric's prefix, its units' prefix)
SIGNALS = {"sequence": (SEQ_ESS_PREFIX, SEQ_UNITS_PREFIX), "weights": (ESS_PREFIX, UNITS_PREFIX)}


@dataclass(frozen=True)
class ControlSettings:
    """What the controller steers by; every field is checked when built."""

    hard: int
    """The ceiling of the bound (`async.max_staleness_hard`); the floor is 0."""
    target_ess: float = 0.7
    """A lag whose ESS (of `signal`) is below this breaks the target (`async.target_ess`)."""
    target_kl: float | None = None
    """A lag whose mean per-token k3 KL(behaviour || learner) is above this breaks the target
    too (`async.target_kl`); None: the ESS alone."""
    start: int = 1
    """The bound before any signal (clamped to `hard`): today's default fixed bound."""
    tighten_after: int = 2
    """Consecutive breaking steps before the bound drops (1: on the first)."""
    relax_after: int = 4
    """Consecutive healthy steps before the bound rises by one."""
    max_backoff: int = 8
    """A failed relax doubles the next wait, up to relax_after × this."""
    min_units: int = 8
    """A lag's ESS counts only over at least this many units (one group's sequences at n=8):
    fewer are noise."""
    signal: str = "sequence"
    """Which ESS by lag is read (`async.staleness_signal`): `sequence`, the untruncated
    sequence ratios' (the shift itself); `weights`, the loss's IS weights' (module doc)."""

    def __post_init__(self) -> None:
        if self.hard < 0 or self.start < 0:
            raise ValueError(f"staleness control: hard and start must be >= 0, got {self}")
        if not 0.0 < self.target_ess <= 1.0:
            raise ValueError(f"staleness control: target_ess must be in (0, 1], got {self}")
        if self.target_kl is not None and not self.target_kl > 0.0:
            raise ValueError(f"staleness control: target_kl must be > 0, got {self}")
        if self.signal not in SIGNALS:
            raise ValueError(
                f"staleness control: signal must be one of {list(SIGNALS)}, got {self}"
            )
        for name in ("tighten_after", "relax_after", "max_backoff", "min_units"):
            if getattr(self, name) < 1:
                raise ValueError(f"staleness control: {name} must be >= 1, got {self}")


@dataclass(frozen=True)
class Decision:
    """One step's outcome: the bound now, how it moved (0: not), why, and the signal."""

    bound: int
    change: int
    reason: str
    signal: float | None
    """The lowest ESS over the lags read (None: no lag 1 .. bound measured this step)."""

    def metrics(self) -> dict[str, float]:
        out = {"staleness_bound": float(self.bound), "staleness_change": float(self.change)}
        if self.signal is not None:
            out["staleness_signal"] = self.signal
        return out


def stale_ess(
    metrics: Mapping[str, Any], bound: int, min_units: int, signal: str = "sequence"
) -> dict[int, float]:
    """{lag: ESS of `signal`} of the lags 1 .. `bound` measured over at least `min_units`
    units."""
    ess, units = SIGNALS[signal]
    return _by_lag(metrics, ess, units, bound, min_units)


def stale_kl(
    metrics: Mapping[str, Any], bound: int, min_units: int, signal: str = "sequence"
) -> dict[int, float]:
    """{lag: mean per-token k3 KL} of the lags 1 .. `bound` whose `signal` ESS is over at
    least `min_units` units (the same rows: a lag of one short response is noise in either)."""
    return _by_lag(metrics, KL_PREFIX, SIGNALS[signal][1], bound, min_units)


def _by_lag(
    metrics: Mapping[str, Any], prefix: str, units_prefix: str, bound: int, min_units: int
) -> dict:
    out = {}
    for key, value in metrics.items():
        if not key.startswith(prefix) or not key[len(prefix) :].isdigit():
            continue
        lag = int(key[len(prefix) :])
        units = metrics.get(f"{units_prefix}{lag}", 0) or 0
        if 1 <= lag <= bound and units >= min_units and _finite(value):
            out[lag] = float(value)
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


_COUNTERS = ("bound", "breaches", "healthy", "relax_wait", "last", "changes")


class StalenessController:
    """The bound and the counters that move it (see the module docstring)."""

    def __init__(self, settings: ControlSettings) -> None:
        self.s = settings
        self.bound = min(settings.start, settings.hard)
        self.breaches = 0  # consecutive steps below target
        self.healthy = 0  # consecutive steps without a breach
        self.relax_wait = settings.relax_after  # healthy steps the next relax needs
        self.last = 0  # the last change's sign: +1 relaxed, -1 tightened, 0 none yet
        self.changes = 0
        self.floor_sum, self.floor_steps = 0.0, 0  # lag 0's ESS, summed over measured steps

    @property
    def floor(self) -> float:
        """The mean lag-0 ESS measured so far (1.0 before any; see the module doc)."""
        return self.floor_sum / self.floor_steps if self.floor_steps else 1.0

    def _add_floor(self, metrics: Mapping[str, Any]) -> None:
        """Count this step's lag-0 ESS into the floor, when it was measured over enough units."""
        ess, units = SIGNALS[self.s.signal]
        lag0 = metrics.get(f"{ess}0")
        if (metrics.get(f"{units}0", 0) or 0) >= self.s.min_units and _finite(lag0) and lag0 > 0:
            self.floor_sum, self.floor_steps = self.floor_sum + min(1.0, lag0), self.floor_steps + 1

    def _relative(self, metrics: Mapping[str, Any]) -> dict[int, float]:
        """This step's admitted lags' ESS over the floor."""
        measured = stale_ess(metrics, self.bound, self.s.min_units, self.s.signal)
        return {lag: min(1.0, value / self.floor) for lag, value in measured.items()}

    def observe(self, metrics: Mapping[str, Any]) -> Decision:
        """One learner step's metrics in; the bound (changed or not) out."""
        self._add_floor(metrics)
        ess = self._relative(metrics)
        signal = min(ess.values(), default=None)
        broken = self._broken(ess, metrics)
        self.breaches, self.healthy = (self.breaches + 1, 0) if broken else (0, self.healthy + 1)
        if broken and self.breaches >= self.s.tighten_after and self.bound > 0:
            lag = min(broken)
            why = f"{broken[lag]} for {self.breaches} step(s)"
            return self._move(min(self.bound - 1, lag - 1), why, signal)
        if not broken and self.healthy >= self.relax_wait and self.bound < self.s.hard:
            shown = "no stale group measured" if signal is None else f"lowest ESS {signal:.3f}"
            why = f"{self.healthy} healthy steps ({shown}, {self._targets()})"
            return self._move(self.bound + 1, why, signal)
        return Decision(self.bound, 0, "", signal)

    def _broken(self, ess: dict[int, float], metrics: Mapping[str, Any]) -> dict[int, str]:
        """{lag: what it broke} of the admitted lags off target this step."""
        name = "sequence-ratio ESS" if self.s.signal == "sequence" else "IS weights' ESS"
        if self.floor < 1.0:
            name = f"{name} over lag 0's {self.floor:.3f}"
        out = {lag: f"{name} at lag {lag} {value:.3f} < target {self.s.target_ess:g}"
               for lag, value in ess.items() if value < self.s.target_ess}  # fmt: skip
        if self.s.target_kl is not None:
            kl = stale_kl(metrics, self.bound, self.s.min_units, self.s.signal)
            for lag, value in kl.items():
                if value > self.s.target_kl and lag not in out:
                    out[lag] = f"KL at lag {lag} {value:.4g} > target {self.s.target_kl:g}"
        return out

    def _targets(self) -> str:
        kl = "" if self.s.target_kl is None else f", KL target {self.s.target_kl:g}"
        return f"{self.s.signal} ESS target {self.s.target_ess:g}{kl}"

    def _move(self, bound: int, why: str, signal: float | None) -> Decision:
        bound = max(0, min(self.s.hard, bound))
        change, old = bound - self.bound, self.bound
        if change < 0:  # a relax that failed before the next one: wait longer next time
            cap = self.s.relax_after * self.s.max_backoff
            failed = self.last > 0
            self.relax_wait = min(cap, self.relax_wait * 2) if failed else self.s.relax_after
        elif self.last > 0:  # the previous relax held: back to the short wait
            self.relax_wait = self.s.relax_after
        self.bound, self.last = bound, (1 if change > 0 else -1)
        self.breaches = self.healthy = 0
        self.changes += 1
        verb = "tightened" if change < 0 else "relaxed"
        return Decision(bound, change, f"staleness bound {verb} {old} -> {bound}: {why}", signal)

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int | float]:
        return {
            "bound": self.bound,
            "breaches": self.breaches,
            "healthy": self.healthy,
            "relax_wait": self.relax_wait,
            "last": self.last,
            "changes": self.changes,
            "floor_steps": self.floor_steps,
            "floor_sum": self.floor_sum,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`; a bound over this run's `hard` is clamped to it. Raises
        KeyError / TypeError / ValueError on a malformed state, changing nothing. A state saved
        before the lag-0 floor was kept starts the floor afresh."""
        values: dict[str, int | float] = {key: int(state[key]) for key in _COUNTERS}
        values["floor_steps"] = int(state.get("floor_steps", 0))
        values["floor_sum"] = float(state.get("floor_sum", 0.0))
        if min(values["bound"], values["relax_wait"]) < 0 or values["last"] not in (-1, 0, 1):
            raise ValueError(f"staleness control state out of range: {values}")
        if not 0 <= values["floor_sum"] <= values["floor_steps"]:  # each step's ESS is in [0, 1]
            raise ValueError(f"staleness control state out of range: {values}")
        values["bound"] = min(values["bound"], self.s.hard)
        values["relax_wait"] = max(1, values["relax_wait"])
        for key, value in values.items():
            setattr(self, key, value)

"""The replay queue: admission and the group buffer behind one lock, as the loop uses them.

Rollout workers start a prompt only once `admission` admits it (the staleness capacity rule
and the run's one in-flight ledger, `admission.py`); the receive pump `put`s each finished
group into the buffer (`buffer.py`), which tells admission what became of it; the learner
`take`s batches no staler than the bound (blocking in its own thread if it likes) and
`set_version` opens admission for the next version. The invariants live with their owners:
the budget in `admission.py`, conservation and staleness in `buffer.py`; the two meet in
``accepted = taken + depth``, checked when a state is loaded.

What happens to a group that would exceed `max_staleness` is the stale policy's
(`ReplayConfig.stale_policy`):

- ``evict``: it is evicted (on arrival or once it ages past the bound) and its admission slot
  reopens, so a fresh prompt replaces it. Take order: arrival.
- ``wait``: nothing is evicted. Admission starts no new prompt and `take` hands out no batch
  while a prompt in flight would be over the bound if the learner moved on (the gate in
  `admission.py`): the engines finish it, the learner trains it within the bound (idling
  meanwhile, measured as its wait). Take order: stalest first.
- ``correct``: groups up to `max_staleness_hard` are trained (the learner's rollout IS weighs
  them by pi_prox / pi_behaviour); staler ones are evicted. Take order: stalest first.

The bound may move (`ReplayConfig.control`, `async.max_staleness: auto`): `observe` feeds each
learner step's metrics to the controller (`staleness_control.py`), and a new bound applies at
once to admission's budget and wait gate, to the buffer's eviction (evict) and to the
`over_bound` count of groups taken past it. Groups started under a looser bound are then
evicted (evict), trained up to `max_staleness_hard` with IS (correct), or waited for and
trained (wait). A token budget (`ReplayConfig.tokens`, `tokens.py`) bounds the tokens in flight
and buffered beside the group budget, with every policy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.replay.admission import Admission, Payload, ReplayError
from asyncrl.replay.buffer import DuplicateGroupError, GroupBuffer
from asyncrl.replay.filters import GroupFilter, filter_name
from asyncrl.replay.staleness_control import ControlSettings, Decision, StalenessController
from asyncrl.replay.tokens import TokenBudget
from asyncrl.types import TrajectoryGroup

# The façade's errors are its users' to catch: ReplayError (bad use), DuplicateGroupError (put).
__all__ = ["DuplicateGroupError", "ReplayConfig", "ReplayError", "ReplayQueue"]

STATE_FORMAT = 2
STALE_POLICIES = ("evict", "wait", "correct")


@dataclass(frozen=True)
class ReplayConfig:
    """The replay queue's own sub-config."""

    max_staleness: int = 0
    """Largest allowed `learner version − group.min_version()`; staler groups are evicted.
    0 = synchronous RL (each batch sampled by the current weights)."""
    rollout_batch_size: int = 1
    """Groups (prompts) the learner consumes per version; scales the admission budget."""
    filters: tuple[GroupFilter, ...] = ()
    """Keep-predicates `(group) -> bool` applied in order on put (see `replay/filters.py`)."""
    dedup_window: int | None = 100_000
    """How many recently put group ids are remembered to reject duplicates (buffered ids are
    always checked); None = remember every id of the run."""
    stale_policy: str = "evict"
    """What becomes of a group staler than `max_staleness`: evict | wait | correct (see the
    module docstring)."""
    max_staleness_hard: int | None = None
    """correct: groups staler than this are still evicted (>= max_staleness); with `control`,
    the ceiling of the bound."""
    tokens: TokenBudget | None = None
    """A bound on the tokens in flight and buffered (`tokens.py`); None: groups only."""
    control: ControlSettings | None = None
    """The adaptive bound's settings (`staleness_control.py`): the bound starts at
    `control.start`; `control.hard` must equal `max_staleness_hard` (>= max_staleness)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "filters", tuple(self.filters))
        if self.max_staleness < 0:
            raise ReplayError(f"replay.max_staleness must be >= 0, got {self.max_staleness}")
        if self.stale_policy not in STALE_POLICIES:
            raise ReplayError(
                f"replay.stale_policy: {self.stale_policy!r} is not one of "
                f"{', '.join(STALE_POLICIES)}"
            )
        hard = self.max_staleness_hard
        if self.stale_policy == "correct" and (hard is None or hard < self.max_staleness):
            raise ReplayError(
                f"replay.max_staleness_hard must be >= max_staleness ({self.max_staleness}) "
                f"with stale_policy correct, got {hard}"
            )
        if self.rollout_batch_size < 1:
            raise ReplayError(
                f"replay.rollout_batch_size must be >= 1, got {self.rollout_batch_size}"
            )
        if self.control is not None and (
            self.max_staleness_hard != self.control.hard or self.max_staleness > self.control.hard
        ):
            raise ReplayError(
                f"replay.control: its ceiling {self.control.hard} must be max_staleness_hard "
                f"({self.max_staleness_hard}) and >= max_staleness ({self.max_staleness})"
            )
        if self.dedup_window is not None and self.dedup_window < 0:
            raise ReplayError(f"replay.dedup_window must be >= 0 or None, got {self.dedup_window}")
        for f in self.filters:
            if not callable(f):
                raise ReplayError(f"replay.filters: {f!r} is not callable")

    def eviction_bound(self, bound: int) -> int | None:
        """The staleness beyond which the buffer evicts (None: never) while the soft bound
        is `bound`."""
        return {"evict": bound, "wait": None}.get(self.stale_policy, self.max_staleness_hard)


class ReplayQueue:
    """`admission` (shared with the dispatcher) and the buffer, under one lock."""

    def __init__(self, config: ReplayConfig, version: int = 0) -> None:
        self.config = config
        lock = threading.RLock()  # re-entrant: admission takes it too, alone or inside ours
        self._cond = threading.Condition(lock)
        self._closed = False
        self.controller = None if config.control is None else StalenessController(config.control)
        bound = config.max_staleness if self.controller is None else self.controller.bound
        self.admission = Admission(
            bound, config.rollout_batch_size, version, lock, self._wait,
            tokens=config.tokens, buffered_tokens=lambda: self._buffer.tokens,
        )  # fmt: skip
        self._buffer = self._new_buffer(bound=bound)

    @property
    def _wait(self) -> bool:
        return self.config.stale_policy == "wait"

    @property
    def bound(self) -> int:
        """The staleness bound in force (fixed, or the controller's)."""
        return self.admission.max_staleness

    def _new_buffer(
        self, state: dict[str, Any] | None = None, bound: int | None = None
    ) -> GroupBuffer:
        cfg = self.config
        bound = self.config.max_staleness if bound is None else bound
        args = (cfg.eviction_bound(bound), self._filter_names(), cfg.dedup_window)
        stalest_first = cfg.stale_policy != "evict"
        if state is None:
            return GroupBuffer(*args, stalest_first=stalest_first)
        return GroupBuffer.from_state(*args, state, stalest_first=stalest_first)

    def _filter_names(self) -> list[str]:
        return [filter_name(f) for f in self.config.filters]

    # -- admission ----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.admission.version

    def set_version(self, version: int) -> None:
        """The learner's current weight version; raises the budget and evicts groups that
        became too stale (freeing their admission slots at once)."""
        with self._cond:
            self.admission.set_version(version)
            self.admission.dropped(self._buffer.evict_stale(version))

    def capacity(self) -> int:
        """How many prompts may start now (never negative)."""
        return self.admission.capacity()

    def reserve(
        self, k: int, prompt_keys: Sequence[str], payloads: Sequence[Payload] | None = None
    ) -> int:
        """Admit up to k prompts into the in-flight ledger (`Admission.reserve`)."""
        return self.admission.reserve(k, prompt_keys, payloads)

    # -- put / take ---------------------------------------------------------------------------
    def put(self, group: TrajectoryGroup, prompt_key: str | None = None) -> bool:
        """Deliver a finished group; returns True if it was buffered, False if a filter dropped
        it or it arrived already too stale (evicted). Either way its prompt (`prompt_key`,
        default its group id) leaves the ledger. Raises DuplicateGroupError if the group id
        was already put (counted, nothing else changed)."""
        if not isinstance(group, TrajectoryGroup):
            raise ReplayError(f"replay.put: expected a TrajectoryGroup, got {type(group).__name__}")
        # Filters are pure: run them before touching any state (and outside the lock), so one
        # that raises leaves the queue as it was.
        dropped_by = next((filter_name(f) for f in self.config.filters if not f(group)), None)
        with self._cond:
            kept = self._buffer.put(group, self.admission.version, dropped_by)
            self.admission.delivered(group.group_id if prompt_key is None else prompt_key, kept)
            if kept or self._wait:  # a delivery may also reopen the wait gate
                self._cond.notify_all()
            return kept

    def take(
        self, n: int, current_version: int, timeout: float | None = 0.0
    ) -> list[TrajectoryGroup] | None:
        """The n oldest groups (arrival order under evict, stalest first otherwise) within the
        eviction bound at `current_version`, or None if fewer are available, or (wait policy)
        while a prompt in flight would then exceed the bound. Staler groups are evicted first.
        `timeout`: 0 = don't wait, seconds = wait at most that long, None = wait until enough
        arrive or `close()`."""
        if n < 0:
            raise ReplayError(f"replay.take: n must be >= 0, got {n}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self.admission.dropped(self._buffer.evict_stale(current_version))
                held = self._wait and self.admission.stale_in_flight()
                groups = None if held else self._buffer.take(n, current_version, self.bound)
                if groups is not None:
                    if self.config.tokens is not None:  # their tokens are free for new prompts
                        self.admission.opened()
                    return groups
                remaining = None if deadline is None else deadline - time.monotonic()
                if self._closed or (remaining is not None and remaining <= 0):
                    return None
                self._cond.wait(remaining)

    def close(self) -> None:
        """Wake every blocked `take` (it returns None); later takes no longer wait."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._buffer)

    # -- observability and checkpoint ---------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Flat scalar metrics (prefix them in the sink): admission (version, running,
        accepted, capacity, budget, unreserved; `stale_in_flight` under wait; with a token
        budget `tokens_in_flight`, `tokens_held`, `tokens_held_peak`, `token_budget`) and
        buffer (depth, counters, per-filter drops, lag histograms `lag_buffered/<k>` and
        `lag_taken/<k>`, the length bias `generated_length_mean`, `trained_length_mean`,
        `length_ratio`, `tokens_buffered` and its peak, and `over_bound`: groups trained
        staler than the bound in force when they were taken), and `staleness_bound`."""
        with self._cond:
            out = self.admission.metrics() | self._buffer.metrics(self.admission.version)
            out["staleness_bound"] = self.bound
            return out

    # -- the adaptive bound -------------------------------------------------------------------
    def observe(self, step_metrics: dict[str, Any]) -> Decision | None:
        """A learner step's metrics, for the adaptive bound (None without one): its decision,
        already applied (`set_bound`)."""
        if self.controller is None:
            return None
        with self._cond:
            decision = self.controller.observe(step_metrics)
            if decision.change:
                self.set_bound(decision.bound)
            return decision

    def set_bound(self, bound: int) -> None:
        """Apply a staleness bound now: admission's budget and gate, the buffer's eviction."""
        with self._cond:
            self.admission.set_max_staleness(bound)
            self._buffer.max_staleness = self.config.eviction_bound(bound)
            self.admission.dropped(self._buffer.evict_stale(self.admission.version))
            self._cond.notify_all()  # a looser bound may free a batch the wait gate held

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, as plain data, in one snapshot (a prompt is buffered,
        outstanding or gone, never two of these): admission's version, counters and ledger
        (`outstanding`: prompt payloads, pending first), the buffer's groups (wire frames
        as bytes), counters, dedup window and recently evicted ids, and the adaptive bound's
        controller (`staleness_control`). Token counts are not stored: the groups and the
        outstanding prompts give them back."""
        with self._cond:
            control = {} if self.controller is None else {
                "staleness_control": self.controller.state_dict()
            }  # fmt: skip
            return {
                "format": STATE_FORMAT,
                **self.admission.state_dict(),
                **self._buffer.state_dict(),
                **control,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()` (all or nothing: a malformed state raises ReplayError and
        leaves the queue unchanged). The outstanding prompts come back pending: re-issued
        first, still counted as running (and charged their estimate). A state saved without a
        controller (a fixed bound) starts the adaptive one afresh."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ReplayError(f"replay state: expected a dict with format {STATE_FORMAT}")
        cfg = self.config
        try:
            controller, bound = self._restored_controller(state)
            admission = Admission.from_state(
                bound, cfg.rollout_batch_size, state, self._wait, cfg.tokens
            )
            buffer = self._new_buffer(state, bound)
            if admission.accepted != buffer.counts["taken"] + len(buffer):
                raise ValueError("accepted != taken + depth: counters disagree with the groups")
            if "over_bound" not in state["counters"]:  # saved before it was counted at take
                lags = buffer.lag_taken.items()
                buffer.counts["over_bound"] = sum(n for k, n in lags if k > cfg.max_staleness)
        except (KeyError, TypeError, ValueError) as exc:
            raise ReplayError(f"replay state: malformed ({type(exc).__name__}: {exc})") from None
        with self._cond:
            self.controller = controller
            self.admission.adopt(admission)
            self.admission.set_max_staleness(bound)
            self._buffer = buffer
            self._cond.notify_all()

    def _restored_controller(self, state: dict[str, Any]) -> tuple[StalenessController | None, int]:
        """The controller `state` holds (a fresh one if it holds none) and its bound."""
        if self.config.control is None:
            return None, self.config.max_staleness
        controller = StalenessController(self.config.control)
        if "staleness_control" in state:
            controller.load_state_dict(state["staleness_control"])
        return controller, controller.bound

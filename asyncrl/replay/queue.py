"""The replay queue: admission and the group buffer behind one lock, as the loop uses them.

Rollout workers start a prompt only once `admission` admits it (the staleness capacity rule
and the run's one in-flight ledger, `admission.py`); the receive pump `put`s each finished
group into the buffer (`buffer.py`), which tells admission what became of it; the learner
`take`s batches no staler than the bound (blocking in its own thread if it likes) and
`set_version` opens admission for the next version. The invariants live with their owners:
the budget in `admission.py`, conservation and staleness in `buffer.py`; the two meet in
``accepted = taken + depth``, checked when a state is loaded.
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
from asyncrl.types import TrajectoryGroup

# The façade's errors are its users' to catch: ReplayError (bad use), DuplicateGroupError (put).
__all__ = ["DuplicateGroupError", "ReplayConfig", "ReplayError", "ReplayQueue"]

STATE_FORMAT = 2


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "filters", tuple(self.filters))
        if self.max_staleness < 0:
            raise ReplayError(f"replay.max_staleness must be >= 0, got {self.max_staleness}")
        if self.rollout_batch_size < 1:
            raise ReplayError(
                f"replay.rollout_batch_size must be >= 1, got {self.rollout_batch_size}"
            )
        if self.dedup_window is not None and self.dedup_window < 0:
            raise ReplayError(f"replay.dedup_window must be >= 0 or None, got {self.dedup_window}")
        for f in self.filters:
            if not callable(f):
                raise ReplayError(f"replay.filters: {f!r} is not callable")


class ReplayQueue:
    """`admission` (shared with the dispatcher) and the buffer, under one lock."""

    def __init__(self, config: ReplayConfig, version: int = 0) -> None:
        self.config = config
        lock = threading.RLock()  # re-entrant: admission takes it too, alone or inside ours
        self._cond = threading.Condition(lock)
        self._closed = False
        self.admission = Admission(config.max_staleness, config.rollout_batch_size, version, lock)
        self._buffer = GroupBuffer(config.max_staleness, self._filter_names(), config.dedup_window)

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
            if kept:
                self._cond.notify_all()
            return kept

    def take(
        self, n: int, current_version: int, timeout: float | None = 0.0
    ) -> list[TrajectoryGroup] | None:
        """The n oldest groups with staleness ≤ max_staleness at `current_version`, or None if
        fewer are available. Staler groups are evicted first. `timeout`: 0 = don't wait,
        seconds = wait at most that long, None = wait until enough arrive or `close()`."""
        if n < 0:
            raise ReplayError(f"replay.take: n must be >= 0, got {n}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self.admission.dropped(self._buffer.evict_stale(current_version))
                groups = self._buffer.take(n, current_version)
                if groups is not None:
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
        accepted, capacity, budget, unreserved) and buffer (depth, counters, per-filter drops,
        lag histograms `lag_buffered/<k>` and `lag_taken/<k>`)."""
        with self._cond:
            return self.admission.metrics() | self._buffer.metrics(self.admission.version)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, as plain data, in one snapshot (a prompt is buffered,
        outstanding or gone, never two of these): admission's version, counters and ledger
        (`outstanding`: prompt payloads, pending first) and the buffer's groups (wire frames
        as bytes), counters, dedup window and recently evicted ids."""
        with self._cond:
            return {
                "format": STATE_FORMAT,
                **self.admission.state_dict(),
                **self._buffer.state_dict(),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()` (all or nothing: a malformed state raises ReplayError and
        leaves the queue unchanged). The outstanding prompts come back pending: re-issued
        first, still counted as running."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ReplayError(f"replay state: expected a dict with format {STATE_FORMAT}")
        cfg = self.config
        try:
            admission = Admission.from_state(cfg.max_staleness, cfg.rollout_batch_size, state)
            buffer = GroupBuffer.from_state(
                cfg.max_staleness, self._filter_names(), cfg.dedup_window, state
            )
            if admission.accepted != buffer.counts["taken"] + len(buffer):
                raise ValueError("accepted != taken + depth: counters disagree with the groups")
        except (KeyError, TypeError, ValueError) as exc:
            raise ReplayError(f"replay state: malformed ({type(exc).__name__}: {exc})") from None
        with self._cond:
            self.admission.adopt(admission)
            self._buffer = buffer
            self._cond.notify_all()

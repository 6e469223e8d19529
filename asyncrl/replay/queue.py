"""The replay queue: where finished trajectory groups wait for the learner.

Rollout actors ask it for admission (`reserve`) before starting a prompt and `put` the finished
group; the learner `take`s batches of groups fresh enough to train on. Pure Python and numpy,
thread-safe (one lock; the learner may block in `take` from its own thread).

Ledger and invariants (all counts are groups; one prompt = one group):

- ``running``  = prompts reserved and not yet put or released (keyed + anonymous).
- ``accepted`` = groups admitted and not dropped = ``taken + depth``. Filtered groups never
  become accepted; evicted groups stop being accepted. They must not count: the learner at
  version v has consumed about v·batch groups, so if dropped groups kept eating the budget the
  learner would wait for groups no actor may start (deadlock). Every dropped group is thus
  replaced by a new prompt.
- ``budget(v)  = (max_staleness + v + 1) · rollout_batch_size``  (AReaL's admission rule) and
  ``capacity = max(0, min(budget(v) − (accepted + running), max_depth − (depth + running)))``.
- If every put was reserved, ``accepted + running ≤ budget(v)`` at all times: `reserve` grants
  at most `capacity`, `put` moves a group from running to accepted (or drops it), eviction and
  filtering only lower ``accepted``, and v never decreases. Likewise ``depth + running ≤
  max_depth``. An unreserved put (a late result after `release`) is admitted and counted in
  ``unreserved``; it may push the sum over the budget, which only lowers capacity.
- Conservation: ``put = taken + evicted + filtered + depth`` (duplicates are not puts).
- Every taken group has staleness ``current_version − group.min_version() ≤ max_staleness``.
  A group with no generated token (min_version() == NOT_GENERATED) has staleness 0.
- With ``max_staleness = 0`` the queue is synchronous: exactly one batch is admitted per version.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.replay.filters import GroupFilter, filter_name
from asyncrl.types import NOT_GENERATED, TrajectoryGroup

STATE_FORMAT = 1
#: How many recently evicted group ids are kept for debugging (`evicted_ids()`).
RECENT_EVICTED = 1024


class ReplayError(ValueError):
    """Bad use of the replay queue: bad config, version going back, bad state dict."""


class DuplicateGroupError(ReplayError):
    """A group id was put twice; the second copy is rejected (and counted)."""


@dataclass(frozen=True)
class ReplayConfig:
    """The replay queue's own sub-config."""

    max_staleness: int = 0
    """Largest allowed `learner version − group.min_version()`; staler groups are evicted.
    0 = synchronous RL (each batch sampled by the current weights)."""
    rollout_batch_size: int = 1
    """Groups (prompts) the learner consumes per version; scales the admission budget."""
    max_depth: int | None = None
    """Optional bound on buffered + in-flight groups (admission stops there); None = no bound."""
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
        if self.max_depth is not None and self.max_depth < 1:
            raise ReplayError(f"replay.max_depth must be >= 1 or None, got {self.max_depth}")
        if self.dedup_window is not None and self.dedup_window < 0:
            raise ReplayError(f"replay.dedup_window must be >= 0 or None, got {self.dedup_window}")
        for f in self.filters:
            if not callable(f):
                raise ReplayError(f"replay.filters: {f!r} is not callable")


def staleness(group: TrajectoryGroup, version: int) -> int:
    """Versions between the group's oldest generated token and `version` (0 if none)."""
    born = group.min_version()
    return 0 if born == NOT_GENERATED else version - born


class ReplayQueue:
    """Staleness-bounded FIFO of `TrajectoryGroup`s with AReaL-style admission control."""

    def __init__(self, config: ReplayConfig, version: int = 0) -> None:
        self.config = config
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._reset(version)

    def _reset(self, version: int) -> None:
        self._version = version
        self._buffer: deque[tuple[int | None, TrajectoryGroup]] = deque()  # (born, group)
        self._buffered_ids: set[str] = set()
        self._in_flight: dict[str, None] = {}  # keyed reservations, insertion-ordered
        self._anonymous = 0
        self._seen: OrderedDict[str, None] = OrderedDict()  # dedup window
        self._counts = Counter(put=0, accepted=0, taken=0, evicted=0, duplicates=0, unreserved=0)
        self._filtered: Counter[str] = Counter({filter_name(f): 0 for f in self.config.filters})
        self._lag_taken: Counter[int] = Counter()
        self._evicted_ids: deque[str] = deque(maxlen=RECENT_EVICTED)

    # -- admission ----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """The learner's current weight version; raises the budget and evicts groups that
        became too stale (freeing their admission slots at once)."""
        with self._cond:
            if version < self._version:
                raise ReplayError(f"replay: version went back from {self._version} to {version}")
            self._version = version
            self._evict_stale(version)

    def capacity(self) -> int:
        """How many prompts may start now (never negative)."""
        with self._cond:
            return self._capacity()

    def _capacity(self) -> int:
        cfg, running = self.config, self._running()
        cap = self._budget() - (self._counts["accepted"] + running)
        if cfg.max_depth is not None:
            cap = min(cap, cfg.max_depth - (len(self._buffer) + running))
        return max(0, cap)

    def _budget(self) -> int:
        return (self.config.max_staleness + self._version + 1) * self.config.rollout_batch_size

    def _running(self) -> int:
        return len(self._in_flight) + self._anonymous

    def reserve(self, k: int = 1, prompt_keys: Sequence[str] | None = None) -> int:
        """Grant up to k prompt starts and mark them running; returns how many were granted.

        With `prompt_keys` (length k) the first `granted` keys are recorded in the in-flight
        ledger (`in_flight()`), so a resumed run can re-issue them; a put whose `prompt_key`
        (default: its group id) matches clears the entry. Without keys the reservations are
        anonymous and any unkeyed put clears one.
        """
        if k < 0:
            raise ReplayError(f"replay.reserve: k must be >= 0, got {k}")
        if isinstance(prompt_keys, str):
            raise ReplayError("replay.reserve: prompt_keys must be a sequence of keys, not a str")
        if prompt_keys is not None and len(prompt_keys) != k:
            raise ReplayError(f"replay.reserve: {len(prompt_keys)} prompt keys for k={k}")
        with self._cond:
            granted = min(k, self._capacity())
            if prompt_keys is None:
                self._anonymous += granted
                return granted
            keys = list(prompt_keys[:granted])
            clash = [key for key in keys if key in self._in_flight]
            if clash or len(set(keys)) != len(keys):
                raise ReplayError(f"replay.reserve: prompt keys already in flight: {clash or keys}")
            self._in_flight.update(dict.fromkeys(keys))
            return granted

    def release(self, k: int = 1, prompt_keys: Sequence[str] | None = None) -> int:
        """Give back reservations of abandoned prompts (actor died, prompt re-issued elsewhere):
        the listed keys, or else k anonymous ones. Keys not in flight (their group already
        arrived) are ignored, so a race with `put` is harmless; returns how many were freed."""
        with self._cond:
            if prompt_keys is None:
                freed = max(0, min(k, self._anonymous))
                self._anonymous -= freed
                return freed
            freed = 0
            for key in prompt_keys:
                if key in self._in_flight:
                    del self._in_flight[key]
                    freed += 1
            return freed

    def in_flight(self) -> list[str]:
        """Keys of the keyed prompts in flight, oldest first (to re-issue after a resume)."""
        with self._cond:
            return list(self._in_flight)

    # -- put / take ---------------------------------------------------------------------------
    def put(self, group: TrajectoryGroup, prompt_key: str | None = None) -> bool:
        """Admit a finished group; returns True if it was buffered, False if a filter dropped
        it or it arrived already too stale (evicted). Either way its reservation is cleared.
        Raises DuplicateGroupError if the group id was already put (counted, nothing changed)."""
        if not isinstance(group, TrajectoryGroup):
            raise ReplayError(f"replay.put: expected a TrajectoryGroup, got {type(group).__name__}")
        # Filters are pure: run them before touching any state, so one that raises leaves the
        # queue as it was.
        dropped_by = next((filter_name(f) for f in self.config.filters if not f(group)), None)
        gid, born = group.group_id, group.min_version()
        born_or_none = None if born == NOT_GENERATED else born
        with self._cond:
            if gid in self._buffered_ids or gid in self._seen:
                self._counts["duplicates"] += 1
                raise DuplicateGroupError(f"replay: group {gid!r} was already put; rejected")
            self._remember(gid)
            self._clear_reservation(gid if prompt_key is None else prompt_key, prompt_key is None)
            self._counts["put"] += 1
            if dropped_by is not None:
                self._filtered[dropped_by] += 1
                return False
            if born_or_none is not None and born_or_none < self._oldest_ok(self._version):
                self._counts["evicted"] += 1
                self._evicted_ids.append(gid)
                return False
            self._buffer.append((born_or_none, group))
            self._buffered_ids.add(gid)
            self._counts["accepted"] += 1
            self._cond.notify_all()
            return True

    def _remember(self, gid: str) -> None:
        window = self.config.dedup_window
        if window == 0:
            return
        self._seen[gid] = None
        if window is not None and len(self._seen) > window:
            self._seen.popitem(last=False)

    def _clear_reservation(self, key: str, allow_anonymous: bool) -> None:
        if key in self._in_flight:
            del self._in_flight[key]
        elif allow_anonymous and self._anonymous > 0:
            self._anonymous -= 1
        else:
            self._counts["unreserved"] += 1

    def _oldest_ok(self, version: int) -> int:
        """The oldest `min_version` still trainable at `version`."""
        return version - self.config.max_staleness

    def _evict_stale(self, version: int) -> int:
        """Drop every buffered group staler than the bound at `version`; returns how many."""
        oldest_ok = self._oldest_ok(version)
        if all(born is None or born >= oldest_ok for born, _ in self._buffer):
            return 0
        keep: deque[tuple[int | None, TrajectoryGroup]] = deque()
        evicted = 0
        for born, group in self._buffer:
            if born is None or born >= oldest_ok:
                keep.append((born, group))
                continue
            self._buffered_ids.discard(group.group_id)
            self._evicted_ids.append(group.group_id)
            evicted += 1
        self._buffer = keep
        self._counts["evicted"] += evicted
        self._counts["accepted"] -= evicted
        return evicted

    def take(
        self, n: int, current_version: int, timeout: float | None = 0.0
    ) -> list[TrajectoryGroup] | None:
        """The n oldest groups with staleness ≤ max_staleness at `current_version`, or None if
        fewer are available. Staler groups are evicted first. `timeout`: 0 = don't wait,
        seconds = wait at most that long, None = wait until enough arrive or `close()`."""
        if n < 0:
            raise ReplayError(f"replay.take: n must be >= 0, got {n}")
        if self.config.max_depth is not None and n > self.config.max_depth:
            raise ReplayError(f"replay.take: n={n} exceeds max_depth={self.config.max_depth}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._evict_stale(current_version)
                if len(self._buffer) >= n:
                    return self._pop(n, current_version)
                remaining = None if deadline is None else deadline - time.monotonic()
                if self._closed or (remaining is not None and remaining <= 0):
                    return None
                self._cond.wait(remaining)

    def _pop(self, n: int, current_version: int) -> list[TrajectoryGroup]:
        out = []
        for _ in range(n):
            born, group = self._buffer.popleft()
            self._buffered_ids.discard(group.group_id)
            self._lag_taken[0 if born is None else current_version - born] += 1
            out.append(group)
        self._counts["taken"] += n
        return out

    def close(self) -> None:
        """Wake every blocked `take` (it returns None); later takes no longer wait."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._buffer)

    # -- observability ------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Flat scalar metrics (prefix them in the sink): ledger, counters, per-filter drops,
        and lag histograms `lag_buffered/<k>` (at the queue's version) and `lag_taken/<k>`."""
        with self._cond:
            c = self._counts
            out: dict[str, float] = {
                "version": self._version,
                "depth": len(self._buffer),
                "running": self._running(),
                "accepted": c["accepted"],
                "capacity": self._capacity(),
                "budget": self._budget(),
                "put": c["put"],
                "taken": c["taken"],
                "evicted": c["evicted"],
                "rejected_duplicates": c["duplicates"],
                "unreserved": c["unreserved"],
                "filtered": sum(self._filtered.values()),
            }
            out.update({f"filtered/{k}": v for k, v in self._filtered.items()})
            lag_buf = Counter(0 if b is None else self._version - b for b, _ in self._buffer)
            out.update({f"lag_buffered/{k}": v for k, v in sorted(lag_buf.items())})
            out.update({f"lag_taken/{k}": v for k, v in sorted(self._lag_taken.items())})
            total_lag = sum(k * v for k, v in self._lag_taken.items())
            out["lag_taken_mean"] = total_lag / c["taken"] if c["taken"] else 0.0
            return out

    def evicted_ids(self) -> list[str]:
        """Ids of the most recently evicted groups (at most RECENT_EVICTED), oldest first."""
        with self._cond:
            return list(self._evicted_ids)

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, as plain data (dicts, lists, str, int, numpy arrays):
        buffered groups as field dicts, counters, the in-flight ledger and the dedup window.
        The group arrays are shared with the queue, not copied: do not mutate them."""
        with self._cond:
            return {
                "format": STATE_FORMAT,
                "version": self._version,
                "groups": [_group_to_plain(g) for _, g in self._buffer],
                "in_flight": list(self._in_flight),
                "anonymous_running": self._anonymous,
                "counters": dict(self._counts),
                "filtered": dict(self._filtered),
                "lag_taken": [[k, v] for k, v in sorted(self._lag_taken.items())],
                "seen_ids": list(self._seen),
                "evicted_ids": list(self._evicted_ids),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()` (all or nothing: a malformed state raises ReplayError and
        leaves the queue unchanged). Keyed in-flight prompts stay reserved: re-issue each key of
        `in_flight()` (or `release` it). Anonymous reservations cannot be re-issued, so they are
        dropped here and their slots return to capacity."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ReplayError(f"replay state: expected a dict with format {STATE_FORMAT}")
        fresh = ReplayQueue(self.config)
        try:
            fresh._restore(state)
        except (KeyError, TypeError, ValueError) as exc:
            raise ReplayError(f"replay state: malformed ({type(exc).__name__}: {exc})") from None
        with self._cond:
            for name in _STATE_ATTRS:
                setattr(self, name, getattr(fresh, name))
            self._cond.notify_all()

    def _restore(self, state: dict[str, Any]) -> None:
        """Fill a fresh, unshared queue from `state` (no locking needed)."""
        self._reset(int(state["version"]))
        for plain in state["groups"]:
            group = TrajectoryGroup(**plain)
            if group.group_id in self._buffered_ids:
                raise ValueError(f"group {group.group_id!r} buffered twice")
            born = group.min_version()
            self._buffer.append((None if born == NOT_GENERATED else born, group))
            self._buffered_ids.add(group.group_id)
        self._in_flight = dict.fromkeys(str(k) for k in state["in_flight"])
        for key, value in state["counters"].items():
            self._counts[str(key)] = int(value)
        for key, value in state["filtered"].items():
            self._filtered[str(key)] = int(value)
        for lag, count in state["lag_taken"]:
            self._lag_taken[int(lag)] = int(count)
        for gid in state["seen_ids"]:
            self._remember(str(gid))
        self._evicted_ids.extend(str(i) for i in state["evicted_ids"])
        if self._counts["accepted"] != self._counts["taken"] + len(self._buffer):
            raise ValueError("counters disagree with the buffered groups (accepted != taken+depth)")


# What `load_state_dict` swaps in from the freshly restored queue.
_STATE_ATTRS = (
    "_version",
    "_buffer",
    "_buffered_ids",
    "_in_flight",
    "_anonymous",
    "_seen",
    "_counts",
    "_filtered",
    "_lag_taken",
    "_evicted_ids",
)


def _group_to_plain(group: TrajectoryGroup) -> dict[str, Any]:
    plain = {f.name: getattr(group, f.name) for f in dataclasses.fields(group)}
    plain["finish_reasons"] = list(group.finish_reasons)
    plain["metadata"] = dict(group.metadata)
    return plain

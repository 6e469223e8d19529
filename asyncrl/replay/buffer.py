"""The group buffer: finished trajectory groups waiting for the learner, oldest first.

It evicts groups staler than its eviction bound (the stale policy's: `max_staleness` for
evict, `max_staleness_hard` for correct, none for wait), refuses duplicate group ids (a re-issued prompt
delivered twice), counts what happened to every group, and stores its groups at rest as the
wire codec's frames (`group_to_bytes`), so a checkpointed group is read back exactly as one
off the wire. Not locked: `ReplayQueue` serialises every call.

Invariants (counts are groups; duplicates are refused and are not puts):

- Conservation: ``put = taken + evicted + filtered + depth``.
- Every taken group has staleness ``version − group.min_version() ≤ max_staleness`` (the
  eviction bound; none: any); a group with no generated token (``min_version() ==
  NOT_GENERATED``) has staleness 0.
- Length bias, exact: ``generated_*`` counts the responses of every put group (filtered and
  evicted ones too), ``trained_*`` those of taken groups; their means' ratio is the bias.
- ``tokens`` = the sequence tokens (`tokens.group_tokens`) of the buffered groups, exactly;
  ``tokens_buffered_peak`` its highest value over the run.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from asyncrl.replay.admission import ReplayError
from asyncrl.replay.tokens import group_tokens
from asyncrl.transport.stored import group_from_bytes, group_to_bytes
from asyncrl.types import NOT_GENERATED, TrajectoryGroup

#: How many recently evicted group ids the state keeps (an audit trail for checkpoints).
RECENT_EVICTED = 1024


class DuplicateGroupError(ReplayError):
    """A group id was put twice; the second copy is refused (and counted)."""


def staleness(group: TrajectoryGroup, version: int) -> int:
    """Versions between the group's oldest generated token and `version` (0 if none)."""
    born = group.min_version()
    return 0 if born == NOT_GENERATED else version - born


def _born(group: TrajectoryGroup) -> int | None:
    born = group.min_version()
    return None if born == NOT_GENERATED else born


class GroupBuffer:
    """Staleness-bounded FIFO of `TrajectoryGroup`s with a dedup window and counters.

    `max_staleness`: the eviction bound (None: never evict). `stalest_first`: `take` returns the
    groups with the oldest tokens first (arrival order among equals) instead of arrival order,
    so a group admitted past the soft bound is trained before it ages further."""

    def __init__(
        self,
        max_staleness: int | None,
        filter_names: Sequence[str] = (),
        dedup_window: int | None = None,
        stalest_first: bool = False,
    ) -> None:
        self.max_staleness, self.dedup_window = max_staleness, dedup_window
        self.stalest_first = stalest_first
        self._groups: deque[tuple[int | None, TrajectoryGroup]] = deque()  # (born, group)
        self._ids: set[str] = set()
        self._seen: OrderedDict[str, None] = OrderedDict()  # dedup window
        self.counts = Counter(put=0, taken=0, evicted=0, duplicates=0)
        for key in ("generated_responses", "generated_tokens", "trained_responses"):
            self.counts[key] = 0
        self.counts["trained_tokens"] = 0
        self.counts["over_bound"] = 0  # taken staler than the soft bound then in force
        self.counts["tokens_buffered_peak"] = 0
        self.tokens = 0  # sequence tokens of the buffered groups
        self.filtered: Counter[str] = Counter(dict.fromkeys(filter_names, 0))
        self.lag_taken: Counter[int] = Counter()
        self.evicted_ids: deque[str] = deque(maxlen=RECENT_EVICTED)

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, group: TrajectoryGroup, version: int, dropped_by: str | None) -> bool:
        """Count a finished group and buffer it unless `dropped_by` (a filter's name) or it is
        already too stale at `version`; returns whether it was buffered. A duplicate id raises
        DuplicateGroupError and changes nothing but the duplicate count."""
        gid = group.group_id
        if gid in self._ids or gid in self._seen:
            self.counts["duplicates"] += 1
            raise DuplicateGroupError(f"replay: group {gid!r} was already put; rejected")
        self._remember(gid)
        self.counts["put"] += 1
        self.counts["generated_responses"] += group.n
        self.counts["generated_tokens"] += group.num_tokens
        if dropped_by is not None:
            self.filtered[dropped_by] += 1
            return False
        born = _born(group)
        if born is not None and self._too_stale(born, version):
            self.counts["evicted"] += 1
            self.evicted_ids.append(gid)
            return False
        self._groups.append((born, group))
        self._ids.add(gid)
        self.tokens += group_tokens(group)
        peak = self.counts["tokens_buffered_peak"]
        self.counts["tokens_buffered_peak"] = max(peak, self.tokens)
        return True

    def _remember(self, gid: str) -> None:
        if self.dedup_window == 0:
            return
        self._seen[gid] = None
        if self.dedup_window is not None and len(self._seen) > self.dedup_window:
            self._seen.popitem(last=False)

    def _too_stale(self, born: int, version: int) -> bool:
        return self.max_staleness is not None and born < version - self.max_staleness

    def evict_stale(self, version: int) -> int:
        """Drop every buffered group staler than the bound at `version`; returns how many."""
        if all(born is None or not self._too_stale(born, version) for born, _ in self._groups):
            return 0
        keep: deque[tuple[int | None, TrajectoryGroup]] = deque()
        for born, group in self._groups:
            if born is None or not self._too_stale(born, version):
                keep.append((born, group))
                continue
            self._ids.discard(group.group_id)
            self.evicted_ids.append(group.group_id)
            self.tokens -= group_tokens(group)
        evicted = len(self._groups) - len(keep)
        self._groups = keep
        self.counts["evicted"] += evicted
        return evicted

    def take(
        self, n: int, version: int, soft_bound: int | None = None
    ) -> list[TrajectoryGroup] | None:
        """The n first groups in take order (call `evict_stale(version)` first), or None if
        fewer are here. Those staler than `soft_bound` are counted (`over_bound`)."""
        if len(self._groups) < n:
            return None
        if self.stalest_first:  # stable: arrival order among groups born at one version
            order = sorted(self._groups, key=lambda bg: version if bg[0] is None else bg[0])
            self._groups = deque(order)
        out = []
        for _ in range(n):
            born, group = self._groups.popleft()
            self._ids.discard(group.group_id)
            lag = 0 if born is None else version - born
            self.lag_taken[lag] += 1
            self.counts["over_bound"] += int(soft_bound is not None and lag > soft_bound)
            self.tokens -= group_tokens(group)
            self.counts["trained_responses"] += group.n
            self.counts["trained_tokens"] += group.num_tokens
            out.append(group)
        self.counts["taken"] += n
        return out

    # -- observability and checkpoint ---------------------------------------------------------
    def metrics(self, version: int) -> dict[str, float]:
        """Counters, per-filter drops, lag histograms `lag_buffered/<k>` (at `version`) and
        `lag_taken/<k>`, and the mean lag of taken groups."""
        c = self.counts
        out: dict[str, float] = {
            "depth": len(self._groups),
            "put": c["put"],
            "taken": c["taken"],
            "evicted": c["evicted"],
            "rejected_duplicates": c["duplicates"],
            "filtered": sum(self.filtered.values()),
            "over_bound": c["over_bound"],
            "tokens_buffered": self.tokens,
            "tokens_buffered_peak": c["tokens_buffered_peak"],
        }
        out.update({f"filtered/{k}": v for k, v in self.filtered.items()})
        lag_buf = Counter(0 if b is None else version - b for b, _ in self._groups)
        out.update({f"lag_buffered/{k}": v for k, v in sorted(lag_buf.items())})
        out.update({f"lag_taken/{k}": v for k, v in sorted(self.lag_taken.items())})
        total_lag = sum(k * v for k, v in self.lag_taken.items())
        out["lag_taken_mean"] = total_lag / c["taken"] if c["taken"] else 0.0
        out.update(self.length_bias())
        return out

    def length_bias(self) -> dict[str, float]:
        """Mean response length of generated (every put group) and trained (taken) responses
        over the run, and trained ÷ generated (1.0: no length bias; absent until both exist)."""
        c = self.counts
        gen = c["generated_tokens"] / c["generated_responses"] if c["generated_responses"] else 0.0
        trained = c["trained_tokens"] / c["trained_responses"] if c["trained_responses"] else 0.0
        out = {"generated_length_mean": gen, "trained_length_mean": trained}
        if gen and trained:
            out["length_ratio"] = trained / gen
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the groups as stored wire frames (bytes), counters, the dedup window and
        the recently evicted ids."""
        return {
            "groups": [group_to_bytes(g) for _, g in self._groups],
            "counters": dict(self.counts),
            "filtered": dict(self.filtered),
            "lag_taken": [[k, v] for k, v in sorted(self.lag_taken.items())],
            "seen_ids": list(self._seen),
            "evicted_ids": list(self.evicted_ids),
        }

    @classmethod
    def from_state(
        cls,
        max_staleness: int | None,
        filter_names: Sequence[str],
        dedup_window: int | None,
        state: dict[str, Any],
        stalest_first: bool = False,
    ) -> GroupBuffer:
        """A new buffer from `state_dict()`. Raises KeyError / TypeError / ValueError
        (DecodeError included) on a malformed state."""
        fresh = cls(max_staleness, filter_names, dedup_window, stalest_first)
        for data in state["groups"]:
            group = group_from_bytes(data)
            if group.group_id in fresh._ids:
                raise ValueError(f"group {group.group_id!r} buffered twice")
            fresh._groups.append((_born(group), group))
            fresh._ids.add(group.group_id)
            fresh.tokens += group_tokens(group)
        for key, value in state["counters"].items():
            fresh.counts[str(key)] = int(value)
        for key, value in state["filtered"].items():
            fresh.filtered[str(key)] = int(value)
        for lag, count in state["lag_taken"]:
            fresh.lag_taken[int(lag)] = int(count)
        for gid in state["seen_ids"]:
            fresh._remember(str(gid))
        fresh.evicted_ids.extend(str(i) for i in state["evicted_ids"])
        return fresh

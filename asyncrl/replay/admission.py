"""Admission: may a prompt start now? AReaL's staleness capacity rule and the run's one
in-flight ledger (pure Python, no groups: testable alone).

Every prompt the run hands out is in the ledger, keyed by its prompt key, from admission until
its group is delivered (put into the buffer, whatever the buffer then does with it):

    reserve ──▶ pending ──issue(w)──▶ on worker w ──reported(w)──▶ in transit
                  ▲                        │ requeue(w): w failed           │
                  └────────────────────────┘                                │
    pending, on worker w, in transit ──delivered (its group was put)──▶ gone

So a prompt is exactly one of pending, in flight (on a worker or in transit) or delivered:
never lost. Pending prompts are (re-)issued first, oldest first. The checkpoint stores the
ledger once (its payloads, pending first), and a resumed run re-issues all of it.

Counts (groups; one prompt = one group):

- ``running``  = prompts in the ledger.
- ``accepted`` = groups admitted into the buffer and not dropped since (the buffer keeps
  ``accepted = taken + depth``). Filtered and evicted groups do not count: the learner at
  version v has consumed about v·batch groups, so if dropped groups kept eating the budget it
  would wait for groups no worker may start (deadlock). Every dropped group is replaced.
- ``budget(v)  = (max_staleness + v + 1) · rollout_batch_size`` and
  ``capacity  = max(0, budget(v) − (accepted + running))``.
- Budget invariant: if every delivered group was reserved, ``accepted + running ≤ budget(v)``
  always: `reserve` grants at most `capacity`, a delivery moves a prompt from running to
  accepted (or drops it), drops only lower ``accepted``, and v never decreases. A group nobody
  reserved is admitted and counted in ``unreserved``; it may push the sum over the budget,
  which only lowers capacity. With ``max_staleness = 0`` exactly one batch is admitted per
  version (synchronous RL).

The ``wait`` stale policy (`wait=True`) adds one gate on top: a prompt started (issued to a
worker) at version a yields a group no fresher than a, trained at the earliest at v + 1 when
the learner at v takes its next batch; it would exceed the bound when ``v + 1 − a >
max_staleness``. While such a prompt is on a worker or in transit (`stale_in_flight`),
admission starts no new prompt (capacity 0) and the learner must not take a batch
(`ReplayQueue.take`): the engines finish it, it is trained within the bound, nothing is
discarded. Pending prompts do not count: they start afresh at the version they are issued at.
The gate reopens once it is delivered (not once trained: the batch that trains it may need
fresh prompts to fill, so waiting longer could deadlock).

With a token budget (`tokens.py`, `async.max_inflight_tokens`) capacity is also bounded in
tokens: each ledger entry carries its prompt's charge (its worst case), released at delivery,
when the group's real tokens enter the buffer's count (read through `buffered_tokens`, the
queue's); a prompt starts only while a worst-case prompt still fits. Both bounds hold at once:
capacity is the smaller. The bound itself (`max_staleness`) may move while the run goes on
(`async.max_staleness: auto`, `staleness_control.py`): the budget follows it at once.

Thread-safe: one lock (re-entrant, so the replay queue shares it and calls in while holding it).
A payload is a plain dict describing the prompt, with its key under ``"key"``; replay looks
further inside it only for a token budget's charge (its ``"prompt_ids"``, `TokenBudget.estimate`).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.replay.tokens import TokenBudget

Payload = dict[str, Any]


class ReplayError(ValueError):
    """Bad use of replay: bad config, version going back, bad reservation, bad state dict."""


@dataclass(slots=True)
class _Entry:
    payload: Payload
    worker: int | None = None  # the worker running it; None while pending or in transit
    started: int | None = None  # the version it was last issued at; None while pending
    tokens: int = 0  # its charge against the token budget (0 without one)


class InFlightLedger:
    """Prompts admitted and not yet delivered, by key, in admission order. Not locked: its
    owner (`Admission`) serialises every call."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._pending: OrderedDict[str, None] = OrderedDict()  # (re-)issue order
        self._load: Counter[int] = Counter()  # prompts on each worker
        self.tokens = 0  # the entries' charges, summed (kept as they come and go)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def add_pending(self, key: str, payload: Payload, tokens: int = 0) -> None:
        if key in self._entries:
            raise ReplayError(f"replay: prompt {key!r} is already in flight")
        self._entries[key] = _Entry(payload, tokens=tokens)
        self._pending[key] = None
        self.tokens += tokens

    def pending(self) -> int:
        return len(self._pending)

    def issue(self, worker: int, n: int, version: int = 0) -> list[Payload]:
        """The n oldest pending prompts, now on `worker`, started at `version`."""
        out = []
        while len(out) < n and self._pending:
            key, _ = self._pending.popitem(last=False)
            entry = self._entries[key]
            entry.worker, entry.started = worker, version
            self._load[worker] += 1
            out.append(entry.payload)
        return out

    def _off_worker(self, key: str, worker: int) -> _Entry | None:
        """The entry of `key` if it is on `worker`, taken off it (else None)."""
        entry = self._entries.get(key)
        if entry is None or entry.worker != worker:
            return None
        entry.worker = None
        self._load[worker] -= 1
        return entry

    def requeue(self, keys: Iterable[str], worker: int) -> int:
        """Prompts of a failed `worker` go back to pending (re-issued next); those no longer on
        it (delivered meanwhile) are skipped. Returns how many went back."""
        moved = 0
        for key in keys:
            entry = self._off_worker(key, worker)
            if entry is not None:
                entry.started = None  # re-issued from scratch: it starts again
                self._pending[key] = None
                moved += 1
        return moved

    def reported(self, keys: Iterable[str], worker: int) -> None:
        """`worker` finished these prompts: their groups are in transit (the slot is free)."""
        for key in keys:
            self._off_worker(key, worker)

    def deliver(self, key: str) -> bool:
        """The prompt's group arrived: forget it wherever it was; False if it was not here."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        if entry.worker is not None:
            self._load[entry.worker] -= 1
        self._pending.pop(key, None)
        self.tokens -= entry.tokens
        return True

    def load(self, workers: int) -> list[int]:
        """Prompts on each of workers 0 .. workers-1."""
        return [self._load[w] for w in range(workers)]

    def oldest_start(self) -> int | None:
        """The lowest version a prompt on a worker or in transit started at (None: none)."""
        starts = [e.started for e in self._entries.values() if e.started is not None]
        return min(starts, default=None)

    def payloads(self) -> list[Payload]:
        """Every outstanding prompt, pending first (re-issue order), then in admission order."""
        ahead = [self._entries[k].payload for k in self._pending]
        rest = [e.payload for k, e in self._entries.items() if k not in self._pending]
        return ahead + rest


class Admission:
    """AReaL's StalenessManager: the capacity rule over `version`, `accepted` and the ledger."""

    def __init__(
        self,
        max_staleness: int,
        rollout_batch_size: int,
        version: int = 0,
        lock: threading.RLock | None = None,
        wait: bool = False,
        tokens: TokenBudget | None = None,
        buffered_tokens: Callable[[], int] = lambda: 0,
    ) -> None:
        """`tokens`: the token budget (None: groups only); `buffered_tokens`: the tokens of
        the groups buffered and not yet trained (the queue's buffer counts them)."""
        self.max_staleness, self.batch, self.wait = max_staleness, rollout_batch_size, wait
        self._lock = lock if lock is not None else threading.RLock()
        self._version = version
        self.accepted = 0
        self.unreserved = 0
        self.ledger = InFlightLedger()
        self.tokens, self.buffered_tokens = tokens, buffered_tokens
        self.held_peak = 0  # the most tokens ever held (in flight + buffered)
        # Called (non-blocking, under the lock) when capacity opens (the version moves, the
        # bound loosens, a taken batch frees tokens): the dispatcher hands out the new prompts
        # at once instead of at its next poll.
        self.on_version: list[Callable[[], None]] = []

    # -- the rule -----------------------------------------------------------------------------
    @property
    def lock(self) -> threading.RLock:
        """The lock every call takes: hold it to count capacity and reserve as one step."""
        return self._lock

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """The learner's weight version: raises the budget. It never goes back."""
        with self._lock:
            if version < self._version:
                raise ReplayError(f"replay: version went back from {self._version} to {version}")
            moved, self._version = version > self._version, version
            if moved:
                self.opened()

    def set_max_staleness(self, bound: int) -> None:
        """Move the staleness bound (`async.max_staleness: auto`); a looser one opens
        capacity at once."""
        if bound < 0:
            raise ReplayError(f"replay: max_staleness must be >= 0, got {bound}")
        with self._lock:
            looser, self.max_staleness = bound > self.max_staleness, bound
            if looser:
                self.opened()

    def opened(self) -> None:
        """Tell the listeners capacity opened (see `on_version`)."""
        for listener in self.on_version:
            listener()

    def budget(self) -> int:
        return (self.max_staleness + self._version + 1) * self.batch

    def running(self) -> int:
        return len(self.ledger)

    def capacity(self) -> int:
        """How many prompts may start now (never negative; 0 while the wait gate is closed)."""
        with self._lock:
            if self.wait and self.stale_in_flight():
                return 0
            free = max(0, self.budget() - (self.accepted + len(self.ledger)))
            return free if self.tokens is None else min(free, self.tokens.fits(self.held()))

    def held(self) -> int:
        """Tokens held outside the learner: the in-flight prompts' charges + the buffered."""
        with self._lock:
            return self.ledger.tokens + self.buffered_tokens()

    def stale_in_flight(self) -> bool:
        """Whether a prompt on a worker or in transit would exceed the bound if the learner
        took one more batch first (`v + 1 − started > max_staleness`; see the module doc)."""
        with self._lock:
            oldest = self.ledger.oldest_start()
            return oldest is not None and self._version + 1 - oldest > self.max_staleness

    def reserve(
        self, k: int, prompt_keys: Sequence[str], payloads: Sequence[Payload] | None = None
    ) -> int:
        """Admit up to k prompts (as many as `capacity` allows, the first keys first) into the
        ledger as pending; returns how many were admitted. `payloads` default to ``{"key": k}``."""
        if k < 0:
            raise ReplayError(f"replay.reserve: k must be >= 0, got {k}")
        if isinstance(prompt_keys, str):
            raise ReplayError("replay.reserve: prompt_keys must be a sequence of keys, not a str")
        if len(prompt_keys) != k or (payloads is not None and len(payloads) != k):
            raise ReplayError(f"replay.reserve: {len(prompt_keys)} prompt keys for k={k}")
        with self._lock:
            granted = min(k, self.capacity())
            keys = list(prompt_keys[:granted])
            clash = [key for key in keys if key in self.ledger]
            if clash or len(set(keys)) != len(keys):
                raise ReplayError(f"replay.reserve: prompt keys already in flight: {clash or keys}")
            for i, key in enumerate(keys):
                payload = {"key": key} if payloads is None else payloads[i]
                self.ledger.add_pending(key, payload, self._charge(payload))
            self.held_peak = max(self.held_peak, self.held())
            return granted

    def _charge(self, payload: Payload) -> int:
        return 0 if self.tokens is None else self.tokens.estimate(payload)

    # -- the dispatcher's moves (see the module docstring) ------------------------------------
    def pending(self) -> int:
        with self._lock:
            return self.ledger.pending()

    def issue(self, worker: int, n: int) -> list[Payload]:
        with self._lock:
            return self.ledger.issue(worker, n, self._version)

    def requeue(self, keys: Iterable[str], worker: int) -> int:
        with self._lock:
            return self.ledger.requeue(keys, worker)

    def reported(self, keys: Iterable[str], worker: int) -> None:
        with self._lock:
            self.ledger.reported(keys, worker)

    def load(self, workers: int) -> list[int]:
        with self._lock:
            return self.ledger.load(workers)

    def outstanding(self) -> list[Payload]:
        with self._lock:
            return self.ledger.payloads()

    # -- the buffer's news --------------------------------------------------------------------
    def delivered(self, key: str, accepted: bool) -> None:
        """A group arrived for prompt `key`: it leaves the ledger (an unreserved one is
        counted); `accepted` = it went into the buffer (else it was filtered or evicted)."""
        with self._lock:
            if not self.ledger.deliver(key):
                self.unreserved += 1
            self.accepted += int(accepted)
            self.held_peak = max(self.held_peak, self.held())  # an unreserved one adds

    def dropped(self, n: int) -> None:
        """n accepted groups were evicted from the buffer: their slots open again."""
        with self._lock:
            self.accepted -= n

    # -- observability and checkpoint ---------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = {
                "version": self._version,
                "running": len(self.ledger),
                "accepted": self.accepted,
                "capacity": self.capacity(),
                "budget": self.budget(),
                "unreserved": self.unreserved,
            }
            if self.wait:  # 1 while the wait gate holds admission and the learner
                out["stale_in_flight"] = int(self.stale_in_flight())
            if self.tokens is not None:  # charges exist only with a budget
                out["tokens_in_flight"] = self.ledger.tokens
                out["tokens_held"] = self.held()
                out["tokens_held_peak"] = self.held_peak
                out["token_budget"] = self.tokens.limit
            return out

    def state_dict(self) -> dict[str, Any]:
        """Plain data: version, counters and the ledger's payloads (pending first)."""
        with self._lock:
            return {
                "version": self._version,
                "accepted": self.accepted,
                "unreserved": self.unreserved,
                "tokens_held_peak": self.held_peak,
                "outstanding": self.ledger.payloads(),
            }

    @classmethod
    def from_state(
        cls,
        max_staleness: int,
        batch: int,
        state: dict[str, Any],
        wait: bool = False,
        tokens: TokenBudget | None = None,
    ) -> Admission:
        """A new Admission from `state_dict()`; every outstanding prompt is pending (re-issued
        first), charged its estimate afresh (it starts again from its prompt). Raises
        KeyError / TypeError / ValueError on a malformed state."""
        fresh = cls(max_staleness, batch, int(state["version"]), wait=wait, tokens=tokens)
        fresh.accepted, fresh.unreserved = int(state["accepted"]), int(state["unreserved"])
        fresh.held_peak = int(state.get("tokens_held_peak", 0))  # absent before token budgets
        for payload in state["outstanding"]:
            key = payload["key"]
            if not isinstance(key, str):
                raise TypeError(f"prompt key must be a str, got {type(key).__name__}")
            fresh.ledger.add_pending(key, payload, fresh._charge(payload))
        return fresh

    def adopt(self, other: Admission) -> None:
        """Take over `other`'s version, counters and ledger (all-or-nothing restore)."""
        with self._lock:
            self._version, self.ledger = other._version, other.ledger
            self.accepted, self.unreserved = other.accepted, other.unreserved
            self.held_peak = other.held_peak

"""Feeds prompts to rollout workers as fast as the replay queue's admission allows.

The in-flight ledger is the run's one ledger, held by the replay queue's `admission`
(`replay/admission.py`): the dispatcher admits fresh prompts into it (`reserve`, as pending),
hands pending prompts to workers with free slots (`issue`, oldest first, so re-issues go
first), frees a slot when a worker reports (`reported`) and puts a failed worker's prompts
back to pending (`requeue`); the receive pump's `put` delivers a prompt. So a prompt is
pending, in flight or delivered — never lost — and the checkpoint stores that ledger once.

Failures: a worker retries a retriable error itself (with backoff) before it reports the
prompt failed; a failed prompt is re-issued. A permanent failure (`PromptResult.permanent`, or
a pool's `PermanentRolloutError`) stops the dispatcher at once, and `check` raises it with the
worker's message in full, so the loop fails with the real error instead of a batch timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from asyncrl.data.prompts import PromptItem
from asyncrl.replay.queue import ReplayQueue
from asyncrl.rollout.settings import PermanentRolloutError, PromptResult


class WorkerPool(Protocol):
    """How the dispatcher reaches rollout workers (Ray in the loop, plain objects in tests)."""

    def size(self) -> int: ...

    def submit(self, worker: int, items: list[PromptItem]) -> Any:
        """Start `items` on a worker; returns a handle for `poll`."""

    def poll(self, timeout: float) -> list[tuple[int, Any, list[PromptResult] | Exception]]:
        """Finished submissions: (worker, handle, results or the exception that ended them),
        waiting up to `timeout` for one (or for `wake`). The pool replaces a dead worker
        itself; its submissions come back as exceptions (a `PermanentRolloutError` when
        replacing it cannot help)."""

    def wake(self) -> None:
        """End a `poll` in progress now (any thread, never blocks): new work may be handed out."""


class Dispatcher:
    """A thread: prompts → workers within admission, results → the ledger. Its own state
    (`handles`, `counters`, `last_error`) is touched only by that thread."""

    def __init__(
        self,
        pool: WorkerPool,
        queue: ReplayQueue,
        next_prompt: Callable[[], PromptItem],
        max_inflight_per_worker: int,
        engine_version: Callable[[], int | None] = lambda: None,
    ) -> None:
        """`engine_version`: the weight version of the engines' last completed sync, stamped
        on every prompt handed out (`PromptItem.engine_version`)."""
        self.pool, self.next_prompt = pool, next_prompt
        self.engine_version = engine_version
        self.admission = queue.admission
        # The learner's new version opens capacity: hand it out now, not at the next poll's end
        # (up to 20 ms later; a synchronous run would wait that long every step).
        self.admission.on_version.append(pool.wake)
        self.max_inflight = max_inflight_per_worker
        self.handles: dict[Any, list[str]] = {}  # submission handle -> its prompt keys
        self.counters = {"dispatched": 0, "reissued": 0, "failed_prompts": 0, "actor_failures": 0}
        self.counters["permanent_failures"] = 0
        self.last_error = ""
        self.poll_s = 0.02  # the longest a poll waits (a finished submission or `wake` ends it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="asyncrl-dispatch", daemon=True)
        self.error: BaseException | None = None
        self._rounds = 0  # dispatch rounds run (`open_capacity` waits for the next one)
        self._round_done = threading.Condition()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Dispatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.pool.wake()
        self._thread.join(timeout=10)
        if self.pool.wake in self.admission.on_version:
            self.admission.on_version.remove(self.pool.wake)

    def __enter__(self) -> Dispatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set() and self.error is None:
                self.dispatch_once()
                with self._round_done:
                    self._rounds += 1
                    self._round_done.notify_all()
                self.reap(timeout=self.poll_s)
        except BaseException as e:  # surfaced to the training loop by `check`
            self.error = e

    def open_capacity(self, opening: Callable[[], None], timeout_s: float) -> bool:
        """Run `opening` (what gives admission new capacity: the learner's new version, which
        wakes this thread) and wait, at most `timeout_s`, for this thread's next dispatch
        round, so the new prompts are on their way before the caller goes on. Whether a round
        ended in time (a round already under way when `opening` ran may end it without them:
        they go out one round later, as without this wait; nothing is lost either way).

        Why wait: the loop's thread shares the driver's core with this one and, going on, would
        run its bookkeeping first, which delays the next generation, and the dispatch would
        then preempt the next learner step instead."""
        with self._round_done:
            before = self._rounds
        opening()
        with self._round_done:
            return self._round_done.wait_for(lambda: self._rounds > before, timeout_s)

    def check(self) -> None:
        """Raise what stopped the dispatcher: a permanent rollout error as itself (its message
        is the worker's, whole), anything else as a RuntimeError naming it."""
        if isinstance(self.error, PermanentRolloutError):
            raise PermanentRolloutError(str(self.error)) from self.error
        if self.error is not None:
            raise RuntimeError(f"dispatcher failed: {self.error}") from self.error

    # -- one round ---------------------------------------------------------------------------
    def dispatch_once(self) -> int:
        """Hand prompts to workers with free slots: pending ones first, then fresh ones within
        admission capacity. Returns how many were handed out."""
        sent = 0
        for worker, used in enumerate(self.admission.load(self.pool.size())):
            free = self.max_inflight - used
            if free <= 0:
                continue
            self._admit_fresh(free - self.admission.pending())
            stamp = {"engine_version": self.engine_version()}
            items = [PromptItem(**{**p, **stamp}) for p in self.admission.issue(worker, free)]
            if not items:
                break  # nothing pending, no capacity: the next workers would get nothing too
            handle = self.pool.submit(worker, items)
            self.handles[handle] = [it.key for it in items]
            sent += len(items)
            self.counters["dispatched"] += len(items)
        return sent

    def _admit_fresh(self, wanted: int) -> None:
        """Draw up to `wanted` new prompts, as many as admission grants, into the ledger."""
        # Under admission's lock: capacity can shrink meanwhile (the wait policy's gate closes
        # when the learner's version moves), and a prompt drawn but not reserved would be lost.
        # A token budget counts room for worst-case prompts, then charges each drawn prompt its
        # own (smaller) estimate: ask again until admission grants none (each round grants one
        # or more, so this ends).
        with self.admission.lock:
            while (granted := min(wanted, self.admission.capacity())) > 0:
                fresh = [self.next_prompt() for _ in range(granted)]
                keys, payloads = [it.key for it in fresh], [vars(it) for it in fresh]
                if self.admission.reserve(granted, keys, payloads) != granted:
                    raise RuntimeError("dispatcher: admission granted fewer than it counted")
                wanted -= granted

    def reap(self, timeout: float) -> None:
        """Take finished submissions from the pool: delivered prompts free their worker's
        slot, failed ones go back to pending (re-issued first)."""
        for worker, handle, outcome in self.pool.poll(timeout):
            keys = self.handles.pop(handle, [])
            if isinstance(outcome, Exception):
                self.last_error = f"rollout worker {worker}: {type(outcome).__name__}: {outcome}"
                self.counters["actor_failures"] += 1
                if isinstance(outcome, PermanentRolloutError):
                    self._permanent(self.last_error)
                failed = keys
            else:
                done = {r.key for r in outcome if r.ok}
                failed = [key for key in keys if key not in done]  # unanswered ones too
                for r in outcome:
                    if not r.ok:
                        self.last_error = r.error
                    if r.permanent:
                        self._permanent(f"rollout worker {worker}, prompt {r.key}: {r.error}")
                self.admission.reported(done, worker)
            # Even when the run stops: the ledger stays exact (a checkpoint may still be taken).
            self.counters["reissued"] += self.admission.requeue(failed, worker)
            self.counters["failed_prompts"] += len(failed)

    def _permanent(self, message: str) -> None:
        """A failure no retry can fix: the first one stops the dispatcher (see `check`)."""
        self.counters["permanent_failures"] += 1
        if self.error is None:
            self.error = PermanentRolloutError(message)

    def metrics(self) -> dict[str, float]:
        out = {f"rollout/{k}": float(v) for k, v in self.counters.items()}
        out["rollout/inflight_prompts"] = float(self.admission.running())
        own = getattr(self.pool, "metrics", None)  # a pool's own figures, where it has them
        if own is not None:
            out.update(own())
        return out

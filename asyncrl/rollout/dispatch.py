"""Feeds prompts to rollout workers as fast as the replay queue's admission allows.

The in-flight ledger is the run's one ledger, held by the replay queue's `admission`
(`replay/admission.py`): the dispatcher admits fresh prompts into it (`reserve`, as pending),
hands pending prompts to workers with free slots (`issue`, oldest first, so re-issues go
first), frees a slot when a worker reports (`reported`) and puts a failed worker's prompts
back to pending (`requeue`); the receive pump's `put` delivers a prompt. So a prompt is
pending, in flight or delivered — never lost — and the checkpoint stores that ledger once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from asyncrl.data.prompts import PromptItem
from asyncrl.replay.queue import ReplayQueue
from asyncrl.rollout.settings import PromptResult


class WorkerPool(Protocol):
    """How the dispatcher reaches rollout workers (Ray in the loop, plain objects in tests)."""

    def size(self) -> int: ...

    def submit(self, worker: int, items: list[PromptItem]) -> Any:
        """Start `items` on a worker; returns a handle for `poll`."""

    def poll(self, timeout: float) -> list[tuple[int, Any, list[PromptResult] | Exception]]:
        """Finished submissions: (worker, handle, results or the exception that ended them).
        The pool replaces a dead worker itself; its submissions come back as exceptions."""


class Dispatcher:
    """A thread: prompts → workers within admission, results → the ledger. Its own state
    (`handles`, `counters`, `last_error`) is touched only by that thread."""

    def __init__(
        self,
        pool: WorkerPool,
        queue: ReplayQueue,
        next_prompt: Callable[[], PromptItem],
        max_inflight_per_worker: int,
    ) -> None:
        self.pool, self.next_prompt = pool, next_prompt
        self.admission = queue.admission
        self.max_inflight = max_inflight_per_worker
        self.handles: dict[Any, list[str]] = {}  # submission handle -> its prompt keys
        self.counters = {"dispatched": 0, "reissued": 0, "failed_prompts": 0, "actor_failures": 0}
        self.last_error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="asyncrl-dispatch", daemon=True)
        self.error: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Dispatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def __enter__(self) -> Dispatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.dispatch_once()
                self.reap(timeout=0.02)
        except BaseException as e:  # surfaced to the training loop by `check`
            self.error = e

    def check(self) -> None:
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
            items = [PromptItem(**p) for p in self.admission.issue(worker, free)]
            if not items:
                break  # nothing pending, no capacity: the next workers would get nothing too
            handle = self.pool.submit(worker, items)
            self.handles[handle] = [it.key for it in items]
            sent += len(items)
            self.counters["dispatched"] += len(items)
        return sent

    def _admit_fresh(self, wanted: int) -> None:
        """Draw up to `wanted` new prompts, as many as admission grants, into the ledger."""
        granted = min(wanted, self.admission.capacity())
        if granted <= 0:
            return
        fresh = [self.next_prompt() for _ in range(granted)]
        # Only this thread reserves and capacity never shrinks otherwise: all are granted.
        self.admission.reserve(granted, [it.key for it in fresh], [vars(it) for it in fresh])

    def reap(self, timeout: float) -> None:
        """Take finished submissions from the pool: delivered prompts free their worker's
        slot, failed ones go back to pending (re-issued first)."""
        for worker, handle, outcome in self.pool.poll(timeout):
            keys = self.handles.pop(handle, [])
            if isinstance(outcome, Exception):
                error = f"rollout worker {worker}: {type(outcome).__name__}: {outcome}"
                self.last_error = error[:300]
                self.counters["actor_failures"] += 1
                failed = keys
            else:
                done = {r.key for r in outcome if r.ok}
                failed = [key for key in keys if key not in done]  # unanswered ones too
                errors = [r.error for r in outcome if not r.ok]
                if errors:
                    self.last_error = errors[-1]
                self.admission.reported(done, worker)
            self.counters["reissued"] += self.admission.requeue(failed, worker)
            self.counters["failed_prompts"] += len(failed)

    def metrics(self) -> dict[str, float]:
        out = {f"rollout/{k}": float(v) for k, v in self.counters.items()}
        out["rollout/inflight_prompts"] = float(self.admission.running())
        return out

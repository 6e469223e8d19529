"""Feeds prompts to rollout actors as fast as the replay queue's admission control allows.

The dispatcher owns the in-flight ledger: every prompt it hands out is reserved in the queue
(`reserve`), and stays in `inflight` until its group arrives (`ReplayQueue.put` clears the
reservation) or its actor reports failure, in which case it goes back to `pending` and is
re-issued first. So a prompt is either pending, in flight or delivered — never lost — and the
checkpoint can save `pending + inflight` to re-issue on resume.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from asyncrl.rollout.actor import PromptItem, PromptResult


class ActorPool(Protocol):
    """How the dispatcher reaches actors (Ray in the loop, plain objects in tests)."""

    def size(self) -> int: ...

    def submit(self, actor: int, items: list[PromptItem]) -> Any:
        """Start `items` on an actor; returns a handle for `poll`."""

    def poll(self, timeout: float) -> list[tuple[int, Any, list[PromptResult] | Exception]]:
        """Finished submissions: (actor, handle, results or the exception that ended them).
        The pool replaces a dead actor itself; its submissions come back as exceptions."""


class Dispatcher:
    def __init__(
        self,
        pool: ActorPool,
        queue: Any,
        next_prompt: Callable[[], PromptItem],
        max_inflight_per_actor: int,
    ) -> None:
        self.pool, self.queue, self.next_prompt = pool, queue, next_prompt
        self.max_inflight = max_inflight_per_actor
        self.pending: deque[PromptItem] = deque()  # reserved, to be (re-)issued first
        self.inflight: dict[str, tuple[int, PromptItem]] = {}
        self.handles: dict[Any, list[str]] = {}
        self.counters = {"dispatched": 0, "reissued": 0, "failed_prompts": 0, "actor_failures": 0}
        self.last_error = ""
        self._lock = threading.Lock()
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
    def _load(self) -> list[int]:
        load = [0] * self.pool.size()
        for actor, _ in self.inflight.values():
            load[actor] += 1
        return load

    def dispatch_once(self) -> int:
        """Hand prompts to actors with free slots, within the queue's admission capacity."""
        sent = 0
        with self._lock:
            for actor, used in enumerate(self._load()):
                free = self.max_inflight - used
                items = self._take_items(free)
                if not items:
                    continue
                handle = self.pool.submit(actor, items)
                self.handles[handle] = [it.key for it in items]
                for it in items:
                    self.inflight[it.key] = (actor, it)
                sent += len(items)
                self.counters["dispatched"] += len(items)
        return sent

    def _take_items(self, free: int) -> list[PromptItem]:
        items = []
        while free > 0 and self.pending:
            items.append(self.pending.popleft())
            free -= 1
        if free > 0:
            granted = self.queue.capacity()
            fresh = [self.next_prompt() for _ in range(min(free, granted))]
            if fresh:
                self.queue.reserve(len(fresh), [it.key for it in fresh])
            items.extend(fresh)
        return items

    def reap(self, timeout: float) -> None:
        for actor, handle, outcome in self.pool.poll(timeout):
            with self._lock:
                keys = self.handles.pop(handle, [])
                if isinstance(outcome, Exception):
                    self.last_error = f"actor {actor}: {type(outcome).__name__}: {outcome}"[:300]
                    self.counters["actor_failures"] += 1
                    failed = keys
                else:
                    failed = [r.key for r in outcome if not r.ok]
                    errors = [r.error for r in outcome if not r.ok]
                    if errors:
                        self.last_error = errors[-1]
                for key in keys:
                    actor_item = self.inflight.pop(key, None)
                    if key in failed and actor_item is not None:
                        self.pending.append(actor_item[1])  # still reserved: re-issue first
                        self.counters["reissued"] += 1
                self.counters["failed_prompts"] += len(failed)

    # -- checkpoint --------------------------------------------------------------------------
    def outstanding(self) -> list[PromptItem]:
        """Prompts handed out but not delivered: re-issued on resume."""
        with self._lock:
            return list(self.pending) + [item for _, item in self.inflight.values()]

    def restore(self, items: list[PromptItem]) -> None:
        with self._lock:
            self.pending.extend(items)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = {f"rollout/{k}": float(v) for k, v in self.counters.items()}
            out["rollout/inflight_prompts"] = float(len(self.inflight) + len(self.pending))
        return out

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is in flight (used by sync-mode tests and shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self.inflight:
                    return True
            time.sleep(0.01)
        return False

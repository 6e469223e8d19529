"""A text stream written from a thread of its own: the training loop's per-step lines (the
console's step line, `metrics.jsonl`'s row) leave the loop's thread without a system call.

Why: every write or flush of a file or of stdout drops the GIL for its system call, and taking
it back waits for whichever thread took it meanwhile: in the default run the dispatcher, woken
by the sync that just landed, runs its Ray submissions right then. Measured in `asyncrl run`
(the default, async): the console's one line a step took 2.5-3 ms of the training thread
(median), metrics.jsonl's row 0.3 ms, of a ~60 ms step. Here the loop's thread only appends
the text to a queue; the writer thread writes and flushes everything queued, in order.

Contract: text reaches the target in the order written; `drain()` returns once everything
written before it is written and flushed (a checkpoint drains first: the rows up to it are on
disk); `close()` drains, stops the thread and closes the target if this stream owns it. A
failed write (a full disk, a closed pipe) is kept and raised as one MetricsError line by the
next `write`, `drain` or `close`; nothing written after it reaches the target. A process killed
outright loses what the thread had not written yet (the last milliseconds); an exception in the
loop does not (the logger's close drains).
"""

from __future__ import annotations

import queue
import threading
from typing import IO

from asyncrl.metrics.history import MetricsError

#: How long `drain` and `close` wait for the writer thread (a hung disk or pipe fails loudly).
DRAIN_TIMEOUT_S = 60.0


class BackgroundStream:
    """`write(text)` from any one thread; the text reaches `target` on the writer thread."""

    def __init__(self, target: IO[str], name: str, *, owns_target: bool = False) -> None:
        self.target, self.name, self._owns = target, name, owns_target
        # An item is text to write, or an Event to set once everything before it is written.
        self._queue: queue.SimpleQueue[str | threading.Event | None] = queue.SimpleQueue()
        self._error: str | None = None  # the failed write's error, as text (holds no frames)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"asyncrl-{name}", daemon=True)
        self._thread.start()

    def write(self, text: str) -> None:
        self._raise_error()
        if self._closed:
            raise MetricsError(f"metrics: {self.name} written after close")
        self._queue.put(text)

    def drain(self) -> None:
        """Wait until everything written so far is written and flushed to the target."""
        if not self._closed:
            done = threading.Event()
            self._queue.put(done)
            if not done.wait(DRAIN_TIMEOUT_S):
                raise MetricsError(f"metrics: {self.name} not written within {DRAIN_TIMEOUT_S}s")
        self._raise_error()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.drain()
        finally:
            self._closed = True
            self._queue.put(None)
            self._thread.join(DRAIN_TIMEOUT_S)
            if self._owns:
                self.target.close()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise MetricsError(f"metrics: writing {self.name} failed: {self._error}")

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]  # blocks until there is something to do
            while not self._queue.empty():  # and takes everything queued with it: one flush
                items.append(self._queue.get_nowait())
            texts = [item for item in items if isinstance(item, str)]
            if texts and self._error is None:
                try:
                    self.target.write("".join(texts))
                    self.target.flush()
                except Exception as e:  # noqa: BLE001 - kept, raised in the writing thread
                    self._error = f"{type(e).__name__}: {e}"
            for item in items:
                if isinstance(item, threading.Event):
                    item.set()
            if None in items:
                return

"""Coalesce a sender's backlog: groups submitted while the send thread is busy leave together.

A rollout worker finishes groups on its event loop and sends them on one thread (a ZMQ socket
belongs to one thread). When groups finish faster than one message at a time can leave, they
queue up here; the send thread takes everything queued (up to `max_groups`) and sends it in as
few messages as the size limit allows (`Sender.send_many`, the batch layout of `batch.py`).
With no backlog each group leaves alone, as before: batching never delays a group.

Each group's future completes once its message is queued in ZMQ (what `Sender.send`'s return
means), or fails with that message's error (TransportTimeout, EncodeError); the groups of later
messages of the same drain fail with it too, without being tried, so the caller's retry sends
them again. Nothing is dropped.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Executor, Future

from asyncrl.transport.batch import BATCH_BYTES, chunk_groups, encode_groups
from asyncrl.transport.codec import EncodeError
from asyncrl.transport.sender import Sender
from asyncrl.types import TrajectoryGroup


class SendBatcher:
    """Queue groups from any thread; `pool` (one thread, the one that made `sender`) sends
    them. Threads: `submit` from any thread; `sender` is used on `pool`'s thread only."""

    def __init__(self, sender: Sender, pool: Executor, max_groups: int = 64) -> None:
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        self._sender, self._pool, self._max_groups = sender, pool, max_groups
        self._lock = threading.Lock()
        self._queue: deque[tuple[TrajectoryGroup, Future[int]]] = deque()

    def submit(self, group: TrajectoryGroup) -> Future[int]:
        """Queue `group`; the future gives the bytes of the message it left in. Same
        zero-copy caveat as `Sender.send`: do not mutate its arrays until the future is done."""
        future: Future[int] = Future()
        with self._lock:
            self._queue.append((group, future))
        # One drain per submit: a drain that finds the queue emptied by an earlier one (that
        # took this group along in its batch) returns at once.
        self._pool.submit(self._drain)
        return future

    def _drain(self) -> None:
        with self._lock:
            taken = [self._queue.popleft() for _ in range(min(len(self._queue), self._max_groups))]
        budget = min(BATCH_BYTES, self._sender.config.max_message_bytes // 2)
        done = 0
        try:
            for chunk in chunk_groups([g for g, _ in taken], budget):
                self._send_chunk(chunk, [f for _, f in taken[done : done + len(chunk)]])
                done += len(chunk)
        except BaseException as e:  # noqa: BLE001 - handed to every group not yet sent
            for _, future in taken[done:]:
                if not future.done():  # the chunk that failed may have sent some alone
                    future.set_exception(e)
            if not isinstance(e, Exception):
                raise

    def _send_chunk(self, chunk: list[TrajectoryGroup], futures: list[Future[int]]) -> None:
        """One message for `chunk`; if it cannot be encoded, each group alone, so that only
        the group at fault fails (as it would have without batching)."""
        max_bytes = self._sender.config.max_message_bytes
        try:
            frames = encode_groups(chunk, max_bytes=max_bytes)
        except EncodeError:
            if len(chunk) == 1:
                raise
            for group, future in zip(chunk, futures, strict=True):
                try:
                    frames = encode_groups([group], max_bytes=max_bytes)
                except EncodeError as e:
                    future.set_exception(e)
                    continue
                future.set_result(self._sender.send_frames(frames))
            return
        nbytes = self._sender.send_frames(frames)
        for future in futures:
            future.set_result(nbytes)

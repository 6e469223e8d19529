"""Concurrent /generate calls of one event-loop turn, merged into one HTTP request.

A rollout worker builds its prompts' groups concurrently (`asyncio.gather`), and each group's
n samples are one batched /generate. Sent one by one, a worker's 8 groups reach the engine as
8 requests spread over ~5 ms (CPU default): the engine parses 8 bodies on the core it
generates on, prefills the groups in several steps, and the batch waits for the group that
arrived last. Merged, they are one body, one prefill, one reply.

Invariants: a caller gets exactly the replies to its own requests, in order. A merged call
that the engine refuses as a bad request (HTTP 4xx) is sent again per caller, so one caller's
bad request fails that caller alone; any other failure (timeout, connection, 5xx, a reply that
breaks the protocol) is every caller's, as it would have been had each sent its own. A
caller that is cancelled drops its share; the request is cancelled (its connection closed,
which the engine reads as an abort) once every caller of it is gone.

The client keys calls by their body keys and `extra_key` (one namespace per body), and does
not coalesce through an sglang-router, whose /generate takes no batch (`client.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

Req = TypeVar("Req")
Out = TypeVar("Out")


class _Batch:
    """The calls of one turn with one key, and the task that sends them (once flushed)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list, asyncio.Future]] = []
        self.task: asyncio.Task | None = None

    def orphaned(self) -> bool:
        return all(future.done() for _, future in self.calls)


class Coalescer(Generic[Req, Out]):
    """`submit(key, requests)` calls made in one turn of the event loop with equal keys go out
    as one `send(key, all their requests)`; `alone(error)`: whether a merged call that failed
    with `error` is sent again per caller."""

    def __init__(
        self,
        send: Callable[[Hashable, list[Req]], Awaitable[list[Out]]],
        alone: Callable[[BaseException], bool],
    ) -> None:
        self._send, self._alone = send, alone
        self._open: dict[Hashable, _Batch] = {}
        self._tasks: set[asyncio.Task] = set()  # held: the loop keeps only weak references
        self.merged = 0  # calls that went out merged with at least one other

    async def submit(self, key: Hashable, requests: Sequence[Req]) -> list[Out]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        batch = self._open.get(key)
        if batch is None:  # the first of this turn: sent once every ready task has joined
            batch = self._open[key] = _Batch()
            loop.call_soon(self._flush, key)
        batch.calls.append((list(requests), future))
        try:
            return await future
        except asyncio.CancelledError:
            if batch.task is not None and batch.orphaned():
                batch.task.cancel()  # closes the connection: the engine aborts the requests
            raise

    def _flush(self, key: Hashable) -> None:
        batch = self._open.pop(key)
        if batch.orphaned():  # every caller was cancelled before it went out
            return
        batch.task = asyncio.ensure_future(self._run(key, batch.calls))
        self._tasks.add(batch.task)
        batch.task.add_done_callback(self._tasks.discard)

    async def _run(self, key: Hashable, calls: list[tuple[list[Req], asyncio.Future]]) -> None:
        merged = [r for requests, _ in calls for r in requests]
        if len(calls) > 1:
            self.merged += len(calls)
        try:
            outs = await self._send(key, merged)
        except Exception as e:  # noqa: BLE001 - each caller gets it, or its own retry's
            if len(calls) > 1 and self._alone(e):
                await asyncio.gather(*(self._one(key, r, f) for r, f in calls))
            else:
                for _, future in calls:
                    _settle(future, error=e)
            return
        start = 0
        for requests, future in calls:
            _settle(future, outs[start : start + len(requests)])
            start += len(requests)

    async def _one(self, key: Hashable, requests: list[Req], future: asyncio.Future) -> None:
        if future.done():  # its caller is gone
            return
        try:
            _settle(future, await self._send(key, requests))
        except Exception as e:  # noqa: BLE001 - this caller's own failure
            _settle(future, error=e)


def _settle(future: asyncio.Future, result: object = None, error: BaseException | None = None):
    if future.done():  # cancelled by its caller meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)

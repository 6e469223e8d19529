"""Rollout workers in the driver's own process (`rollout.worker_pool: driver`), behind the
dispatcher's `WorkerPool` interface: each `RolloutWorker` on an event loop of its own, in a
thread of its own.

Why: a rollout worker is an I/O-bound client of the engines (HTTP requests out, groups pushed
over ZMQ). On one machine, hosting it as a Ray actor costs Ray's daemons (GCS, raylet,
dashboard server and agent, runtime-env agent, autoscaler and log monitors: seven processes
that each import Ray) and a process per worker importing the rollout stack again; on the CPU
default that was most of the whole command's start. The cost: the workers' Python shares the
driver's interpreter lock and core with the learner, and the loop is slower (the schema's
docstring gives both measured), so Ray's actors (`ray_pool.py`) stay the default, and the
only choice on a cluster (placed beside their engines).

Semantics kept from the Ray pool: a worker that cannot be built raises
`PermanentRolloutError` at start with the real error; a submission that raises comes back from
`poll` as that exception (the dispatcher re-issues its prompts), and `MAX_CONSECUTIVE_DEATHS`
failures of one worker in a row with no answer in between end the run. A thread does not die
as a process does, so nothing is replaced (`restarts` stays 0).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import threading
from collections.abc import Callable
from typing import Any

from asyncrl.data.prompts import PromptItem
from asyncrl.rollout.settings import (
    PromptResult,
    RolloutSettings,
    Wakeup,
    given_up,
    start_failure,
)
from asyncrl.rollout.worker import RolloutWorker


class _Host:
    """One worker's event loop, run by a daemon thread (an exit never waits on it)."""

    def __init__(self, index: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name=f"asyncrl-rollout-{index}", daemon=True
        )
        self.thread.start()
        self.worker: RolloutWorker | None = None

    def call(self, coro: Any) -> cf.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self.loop.close()


async def _build(settings: RolloutSettings) -> RolloutWorker:
    """On the worker's own loop: its HTTP sessions and sockets belong to that loop's thread."""
    return RolloutWorker(settings)


class LocalWorkerPool:
    """`num_workers` rollout workers in this process; worker i gets `settings_for(i)`."""

    def __init__(self, settings_for: Callable[[int], RolloutSettings], num_workers: int) -> None:
        self.hosts = [_Host(i) for i in range(num_workers)]
        self.refs: dict[cf.Future, int] = {}  # submission -> worker
        self.deaths = [0] * num_workers  # in a row, per worker: reset by any answer
        self.restarts = 0
        self._wakeup = Wakeup()
        building = [h.call(_build(settings_for(i))) for i, h in enumerate(self.hosts)]
        errors = []
        for host, built in zip(self.hosts, building, strict=True):
            try:
                host.worker = built.result()
            except Exception as e:  # noqa: BLE001 - reported whole, as the Ray pool does
                errors.append(f"{type(e).__name__}: {e}")
            else:
                errors.append("")
        failure = start_failure(errors)
        if failure is not None:
            self.close()
            raise failure

    def size(self) -> int:
        return len(self.hosts)

    def submit(self, actor: int, items: list[PromptItem]) -> cf.Future:
        worker = self.hosts[actor].worker
        assert worker is not None, "a closed pool"
        ref = self.hosts[actor].call(worker.run_prompts(items))
        self.refs[ref] = actor
        return ref

    def wake(self) -> None:
        self._wakeup.wake()

    def poll(self, timeout: float) -> list[tuple[int, Any, list[PromptResult] | Exception]]:
        """Waits (never spins) until a submission ends, `wake`, or the timeout."""
        self._wakeup.wait(self.refs, timeout)
        out = []
        for ref in [ref for ref in self.refs if ref.done()]:
            actor = self.refs.pop(ref)
            try:
                outcome: Any = ref.result()
                self.deaths[actor] = 0
            except Exception as e:  # noqa: BLE001 - a worker's own failure: re-issued
                self.deaths[actor] += 1
                outcome = given_up(actor, self.deaths[actor], e)
            out.append((actor, ref, outcome))
        return out

    def pids(self) -> list[int]:
        return [os.getpid()] * len(self.hosts)

    def close(self, grace_s: float = 2.0) -> None:
        """End the workers: each closes its connections (at most `grace_s` in all: a worker
        whose send is blocked is left behind), then its loop stops."""
        closing = [h.call(h.worker.aclose()) for h in self.hosts if h.worker is not None]
        cf.wait(closing, timeout=grace_s)
        for host in self.hosts:
            host.worker = None
            host.stop(timeout=grace_s)
        self.hosts = []

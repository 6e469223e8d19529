"""Background health checks of the engines asyncrl started (`EngineFleet.heal` reads them)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence

from asyncrl.engine.client import EngineClient
from asyncrl.engine.process import ServerHandle
from asyncrl.net import AsyncRunner


class HealthMonitor:
    """Background /health_generate checks of every engine asyncrl started, one round at a time
    on the control loop. `poll` never blocks: it takes the answers of the last round, starts
    the next one when due, and names the engines that failed `failures` rounds in a row."""

    def __init__(
        self, runner: AsyncRunner, interval_s: float, timeout_s: float, failures: int
    ) -> None:
        self.runner, self.interval_s, self.timeout_s = runner, interval_s, timeout_s
        self.failures = failures
        self.fails: dict[int, int] = {}  # engine index -> failed rounds in a row
        self._round: concurrent.futures.Future | None = None
        self._due = 0.0

    def poll(self, handles: Sequence[ServerHandle], clients: Sequence[EngineClient]) -> list[int]:
        done = self._round
        if done is not None and done.done():
            self._round = None
            results = [] if done.cancelled() or done.exception() else done.result()
            for i, handle, ok in results:
                if i < len(handles) and handles[i] is handle:  # not relaunched meanwhile
                    self.fails[i] = 0 if ok else self.fails.get(i, 0) + 1
        now = time.monotonic()
        if self._round is None and now >= self._due:
            self._due = now + self.interval_s
            owned = [(i, h, c) for i, (h, c) in enumerate(zip(handles, clients)) if h.owned]
            self._round = asyncio.run_coroutine_threadsafe(self._check(owned), self.runner.loop)
        return sorted(i for i, n in self.fails.items() if n >= self.failures)

    async def _check(self, engines: list) -> list[tuple[int, ServerHandle, bool]]:
        oks = await asyncio.gather(*(c.health(self.timeout_s) for _, _, c in engines))
        return [(i, h, ok) for (i, h, _), ok in zip(engines, oks)]

    def forget(self, index: int) -> None:
        """Engine `index` was relaunched: its record starts afresh."""
        self.fails.pop(index, None)

    def close(self) -> None:
        if self._round is not None:
            self._round.cancel()

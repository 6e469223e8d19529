"""What every layer may use: free loopback ports, the Ray connection, the control event loop.

Kept apart (and tiny) so that the learner, the engines and the rollout workers need not import
one another for a port or for `ray.init`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_ray() -> None:
    """Attach to the Ray cluster named by `RAY_ADDRESS`, or start Ray locally; idempotent."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # Rollout workers take no CPU reservation: they are I/O-bound clients of the engines,
        # and a 2-core laptop must still fit several of them.
        ray.init(include_dashboard=False, num_cpus=max(2, os.cpu_count() or 2), log_to_driver=True)


class AsyncRunner:
    """An asyncio event loop in its own thread, for the control plane (engine health, weight
    sync, evaluation): blocking callers submit coroutines and wait with a timeout."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="asyncrl-control", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)

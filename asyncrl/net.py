"""What every layer may use: free loopback ports, the Ray connection, the control event loop.

Kept apart (and tiny) so that the learner, the engines and the rollout workers need not import
one another for a port or for `ray.init`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


#: Ray's switch for multi-node clusters (read once, when `ray` is imported). Off, Ray takes
#: 127.0.0.1 as the node's address and its servers (GCS, raylet, object manager, workers,
#: runtime-env agent) bind to it alone; on (Ray's default on Linux) Ray turns a loopback
#: `_node_ip_address` into the machine's external address and listens on every interface.
RAY_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


#: Environment variable Ray's raylet reads for its workers' niceness (Ray's default: 15).
RAY_WORKER_NICENESS = "RAY_worker_niceness"


def init_ray() -> None:
    """Attach to the Ray cluster named by `RAY_ADDRESS`, or start Ray locally listening on
    127.0.0.1 only (a local run needs no other interface); idempotent.

    Loopback keeps other machines out, not other local processes: those meet Ray's token
    (`~/.ray/auth_token`, required by default for a local cluster since Ray 2.52; older Ray
    has none). A warning says so if Ray's node still ends up on another address."""
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        os.environ.setdefault(RAY_CLUSTER_SWITCH, "0")  # inherited by Ray's processes
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    _ray_loopback()
    # Ray starts its workers at nice 15, so on a small box where the learner and the engines
    # keep every core busy the rollout workers (which feed the engines and the replay queue)
    # would run only in the gaps: the loop's own processes share the machine as equals.
    os.environ.setdefault(RAY_WORKER_NICENESS, "0")
    # Rollout workers take no CPU reservation: they are I/O-bound clients of the engines,
    # and a 2-core laptop must still fit several of them.
    cpus = max(2, os.cpu_count() or 2)
    ray.init(
        include_dashboard=False, num_cpus=cpus, log_to_driver=True, _node_ip_address="127.0.0.1"
    )
    node_ip = ray.util.get_node_ip_address()
    if node_ip != "127.0.0.1":
        log.warning("Ray's local node is on %s: its servers listen beyond loopback", node_ip)


def _ray_loopback() -> None:
    """Ray reads the switch when it is imported; if something imported it before us (the CLI's
    log set-up does), the constant it keeps is updated here too, unless the user set the
    switch on. Its one reader is `ray._private.services.get_node_ip_address`."""
    if os.environ.get(RAY_CLUSTER_SWITCH) != "0":
        return
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False):
        constants.ENABLE_RAY_CLUSTER = False


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

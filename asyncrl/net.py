"""What every layer may use: free ports, this node's addresses (Ray's node IP, what a bind
address is advertised as), the Ray connection, the control event loop.

Kept apart (and tiny) so that the learner, the engines and the rollout workers need not import
one another for a port or for `ray.init`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the caller binds it soon after)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


#: Ray's switch for multi-node clusters (read once, when `ray` is imported). Off, Ray takes
#: 127.0.0.1 as the node's address and its servers (GCS, raylet, object manager, workers,
#: runtime-env agent) bind to it alone; on (Ray's default on Linux) Ray turns a loopback
#: `_node_ip_address` into the machine's external address and listens on every interface.
RAY_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


#: Environment variable Ray's raylet reads for its workers' niceness (Ray's default: 15).
RAY_WORKER_NICENESS = "RAY_worker_niceness"


#: Bind addresses that mean "every interface": a server bound to one is reached through the
#: node's own address, never through this one.
WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]", "")


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback literal (127.0.0.0/8, ::1); a host name counts as routable."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def node_ip() -> str:
    """This node's routable address as Ray knows it (`ray.util.get_node_ip_address()`: on a Ray
    worker, the address of the node the worker runs on). Ray is imported only here."""
    import ray

    return ray.util.get_node_ip_address()


def advertised_host(bind_host: str) -> str:
    """The address peers use to reach a server bound to `bind_host`: the node's address (from
    Ray) for a wildcard bind, else `bind_host` itself (loopback stays loopback)."""
    return node_ip() if bind_host in WILDCARD_HOSTS else bind_host


def route_ip(peer: str) -> str:
    """This host's address on the route to `peer` (the interface the kernel would send from):
    a UDP socket's connect picks it without sending anything."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer.strip("[]"), 9))
        return s.getsockname()[0]


def url_host(host: str) -> str:
    """`host` as it goes into a URL or a tcp:// endpoint (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def init_ray(address: str | None = None) -> None:
    """Attach to the Ray cluster at `address` (e.g. "auto": the cluster `ray start` made on this
    node; `cluster.address`) or named by `RAY_ADDRESS`, or else start Ray locally listening on
    127.0.0.1 only (a local run needs no other interface); idempotent.

    Loopback keeps other machines out, not other local processes: those meet Ray's token
    (`~/.ray/auth_token`, required by default for a local cluster since Ray 2.52; older Ray
    has none). A warning says so if Ray's node still ends up on another address."""
    with _RAY_INIT_LOCK:
        _init_ray(address)


# Ray is one per process, and a run may start it from two threads at once (the rollout
# workers' start thread, a multi-rank learner's construction): the second waits, then finds it
# up. Process-wide state, so a process-wide lock.
_RAY_INIT_LOCK = threading.Lock()
# The watchdog (`asyncrl.reaper`) of a process that starts a local Ray: one per process, as
# Ray is, and held for the process's life (its stdin closing is what tells it the process is
# gone: a collected handle would close it early).
_WATCHDOG: dict[str, Any] = {}


def ray_env(address: str | None = None) -> None:
    """What `init_ray` sets in the environment for a local Ray (its processes inherit it).
    `init_ray` calls it; a caller about to start Ray on another thread calls it first, from the
    thread it is on: the environment is not thread-safe in C (a setenv while torch, OpenMP or
    CUDA reads it with getenv on the main thread can crash), and once set it is only read."""
    if not (address or os.environ.get("RAY_ADDRESS")):
        os.environ.setdefault(RAY_CLUSTER_SWITCH, "0")  # read by Ray on import
        # Ray starts its workers at nice 15, so on a small box where the learner and the
        # engines keep every core busy the rollout workers (which feed the engines and the
        # replay queue) would run only in the gaps: the loop's processes share it as equals.
        os.environ.setdefault(RAY_WORKER_NICENESS, "0")


def _init_ray(address: str | None) -> None:
    address = address or os.environ.get("RAY_ADDRESS")
    ray_env(address)
    import ray

    if ray.is_initialized():
        return
    if address:
        _ray_cluster_mode()
        ray.init(address=address, log_to_driver=True)
        return
    _ray_loopback()
    _start_watchdog()
    # Rollout workers take no CPU reservation: they are I/O-bound clients of the engines,
    # and a 2-core laptop must still fit several of them.
    cpus = max(2, os.cpu_count() or 2)
    # address="local": always a fresh Ray of this run's own. Without it Ray joins whatever
    # cluster /tmp/ray/ray_current_cluster names (another run's, a `ray start` on the box)
    # and refuses num_cpus there; a multi-node run names its cluster in `cluster.address`.
    start = functools.partial(
        ray.init,
        address="local",
        include_dashboard=False,
        num_cpus=cpus,
        log_to_driver=True,
        _node_ip_address="127.0.0.1",
    )
    _on_a_lasting_thread(start)
    node_ip = ray.util.get_node_ip_address()
    if node_ip != "127.0.0.1":
        log.warning("Ray's local node is on %s: its servers listen beyond loopback", node_ip)


def _start_watchdog() -> None:
    """Start this process's `asyncrl.reaper` unless it runs: what a local Ray starts must not
    outlive a driver killed without cleaning up (`kill -9`)."""
    from asyncrl import reaper

    proc = _WATCHDOG.get("proc")
    if proc is None or proc.poll() is not None:
        _WATCHDOG["proc"] = reaper.start()


def exit_on_signal(signum: int, frame: object) -> None:
    """A signal handler that ends the process as Ctrl-C does: by an exception in the main
    thread, so what the run started stops in order (exit status 128 + signum)."""
    sys.exit(128 + signum)


def sigterm_handler() -> Any:
    """The SIGTERM handler a run keeps over Ray's (`reclaim_sigterm`), taken before Ray
    starts: Python's (the CLI's), or, where none is set (a run started from Python: a bench, a
    notebook), `exit_on_signal`, as Ray itself set when it started on the main thread."""
    handler = signal.getsignal(signal.SIGTERM)
    return exit_on_signal if handler is signal.SIG_DFL else handler


def reclaim_sigterm(handler: Any) -> None:
    """Give SIGTERM back to `handler` (`sigterm_handler()`, taken before Ray started). Ray's
    core worker installs its own when Ray starts (print a stack trace, abort), and started on
    the main thread Ray also sets a Python one (exit status 15), so either way the run's
    handler is lost. Call from the main thread once Ray is up; elsewhere a no-op (only the
    main thread may set handlers). None: a handler set outside Python, left alone."""
    if threading.current_thread() is threading.main_thread() and handler is not None:
        signal.signal(signal.SIGTERM, handler)


def _on_a_lasting_thread(start: Callable[[], object]) -> None:
    """Call `start` (which spawns Ray's GCS and raylet) on a thread that lives as long as the
    process. Ray asks the kernel to kill those processes when the thread that spawned them
    exits (`PR_SET_PDEATHSIG` follows the thread, not the process): started from a run on a
    short-lived thread (a test's, a notebook's, a service's), they were killed as it ended, and
    this process, left without its GCS, was made to exit 60 s later by Ray itself."""
    if threading.current_thread() is threading.main_thread():
        start()
        return
    started, failed = threading.Event(), []

    def keep() -> None:
        try:
            start()
        except BaseException as e:  # handed to the caller
            failed.append(e)
        started.set()
        if not failed:
            threading.Event().wait()  # parked for the life of the process (a daemon thread)

    threading.Thread(target=keep, name="asyncrl-ray-owner", daemon=True).start()
    started.wait()
    if failed:
        raise failed[0]


def _ray_cluster_mode() -> None:
    """Joining a cluster: Ray must find this node's routable address (the one its raylet
    registered), so a loopback-only switch left by an earlier local start in this process is
    undone (Ray reads it on import, and from its constant afterwards)."""
    if os.environ.get(RAY_CLUSTER_SWITCH) == "0":
        del os.environ[RAY_CLUSTER_SWITCH]
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = True


def _ray_loopback() -> None:
    """Ray reads the switch when it is imported; if something imported it before us (the CLI's
    log set-up does), the constant it keeps is updated here too, unless the user set the
    switch on. Its one reader is `ray._private.services.get_node_ip_address`."""
    if os.environ.get(RAY_CLUSTER_SWITCH) != "0":
        return
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False):
        constants.ENABLE_RAY_CLUSTER = False


def in_daemon_thread(fn, *args) -> asyncio.Future:
    """Run blocking `fn` in a daemon thread. Unlike `asyncio.to_thread`, a collective stuck
    until its group timeout never holds up event-loop shutdown."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, exc) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # handed to the awaiting coroutine
            result, exc = None, e
        with contextlib.suppress(RuntimeError):  # loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=run, daemon=True, name=f"asyncrl-{fn.__name__}").start()
    return fut


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

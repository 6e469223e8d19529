"""A watchdog that ends what a local run started when the run's process dies without cleaning
up (`kill -9`, an OOM kill): `python -m asyncrl.reaper <pid>`, started by `net.init_ray` for a
local Ray.

Why: Ray's local node shares its fate with the driver (its raylet and GCS get SIGKILL when the
driver dies), but the raylet's own children do not always follow: after `kill -9` of
`asyncrl run`, Ray's `DashboardAgent` and `RuntimeEnvAgent` were left running (reparented to
init, ignoring SIGTERM), each holding ~100 MB and its ports.

How: the watchdog runs in a session of its own and records, every `POLL_S`, the driver's whole
process tree (pid and start time, so a reused pid is never taken for a recorded one). Its
stdin is a pipe whose only writer is the driver: end of file means the driver is gone, however
it went. It then gives the recorded processes `GRACE_S` to end by themselves (a clean exit has
already stopped Ray) and kills the rest with SIGKILL.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Callable

import psutil

POLL_S = 0.5
GRACE_S = 5.0


def start(pid: int | None = None) -> subprocess.Popen:
    """The watchdog of process `pid` (default: this one), which must keep the returned
    process's stdin open for as long as it lives (it does: the pipe closes when it dies)."""
    pid = os.getpid() if pid is None else pid
    return subprocess.Popen(
        [sys.executable, "-m", "asyncrl.reaper", str(pid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the driver's process group: a Ctrl-C spares it
        close_fds=True,
    )


def tree(pid: int) -> dict[int, float]:
    """{pid: start time} of every living descendant of `pid`."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    out = {}
    for child in children:
        try:
            out[child.pid] = child.create_time()
        except psutil.Error:
            continue
    return out


def _alive(recorded: dict[int, float]) -> list[psutil.Process]:
    """The recorded processes still running as themselves (same pid and start time)."""
    out = []
    for pid, created in recorded.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            continue
    return out


def reap(recorded: dict[int, float], grace_s: float = GRACE_S) -> list[int]:
    """Wait up to `grace_s` for the recorded processes to end, then SIGKILL the rest; the
    pids killed."""
    _, alive = psutil.wait_procs(_alive(recorded), timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            continue
    return [p.pid for p in alive]


def watch(
    pid: int, stdin: int = 0, on_record: Callable[[dict[int, float]], None] | None = None
) -> list[int]:
    """Record `pid`'s process tree until `stdin` reaches end of file, then `reap` it;
    `on_record` sees the record after each poll."""
    recorded: dict[int, float] = {}
    me = os.getpid()
    while True:
        recorded.update({p: t for p, t in tree(pid).items() if p != me})
        if on_record is not None:
            on_record(recorded)
        ready, _, _ = select.select([stdin], [], [], POLL_S)
        if ready and not os.read(stdin, 4096):
            return reap(recorded)


if __name__ == "__main__":
    watch(int(sys.argv[1]))

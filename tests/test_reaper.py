"""The watchdog (`asyncrl.reaper`): a driver killed with SIGKILL leaves no process of its tree
behind, Ray's agents included; a process that ignores SIGTERM too; a clean exit gives the
tree its grace first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from asyncrl import reaper

DEADLINE_S = 60.0


def _gone(pids: dict[int, float], deadline_s: float = DEADLINE_S) -> list[int]:
    """The recorded processes still alive as themselves after waiting up to the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        alive = reaper._alive(pids)
        if not alive:
            return []
        psutil.wait_procs(alive, timeout=0.5)
    return [p.pid for p in reaper._alive(pids)]


def _spawn(code: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )


def _await_line(proc: subprocess.Popen, prefix: str) -> str:
    # readline blocks until the child prints (or exits: then "" and the assert names it)
    line = proc.stdout.readline()
    assert line.startswith(prefix), f"child said {line!r}, rc {proc.poll()}"
    return line


STUBBORN = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ok', flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print("up", child.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_parents_stubborn_child_is_reaped():
    """The watchdog's loop (in a thread here, its stdin a pipe the test holds) records the tree,
    the parent dies by SIGKILL, the pipe closes: the child that ignores SIGTERM is killed."""
    parent = _spawn(STUBBORN)
    child_pid = int(_await_line(parent, "up").split()[1])
    read, write = os.pipe()
    seen, killed = threading.Event(), []

    def on_record(recorded: dict[int, float]) -> None:
        if child_pid in recorded:
            seen.set()

    thread = threading.Thread(
        target=lambda: killed.extend(reaper.watch(parent.pid, read, on_record)), daemon=True
    )
    thread.start()
    try:
        assert seen.wait(DEADLINE_S)
        recorded = {child_pid: psutil.Process(child_pid).create_time()}
        parent.kill()
        parent.wait()
        os.close(write)  # what the driver's death does to the watchdog's stdin
        thread.join(DEADLINE_S)
        assert killed == [child_pid] and _gone(recorded) == []
    finally:
        parent.kill()
        if psutil.pid_exists(child_pid):
            os.kill(child_pid, signal.SIGKILL)


DRIVER = """
import os, ray
from asyncrl import net
net.init_ray(None)

@ray.remote(num_cpus=0)
class Echo:
    def ping(self):
        return os.getpid()

actor = Echo.remote()
print("up", ray.get(actor.ping.remote()), flush=True)
import time; time.sleep(600)
"""


@pytest.mark.timeout(240)
def test_no_process_of_a_local_ray_outlives_a_driver_killed_with_sigkill():
    driver = _spawn(DRIVER)
    try:
        _await_line(driver, "up")
        recorded = reaper.tree(driver.pid)
        names = " ".join(psutil.Process(p).name() for p in recorded if psutil.pid_exists(p))
        assert "raylet" in names and "gcs_server" in names, names
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        left = _gone(recorded)
        assert left == [], [psutil.Process(p).cmdline()[:2] for p in left if psutil.pid_exists(p)]
    finally:
        driver.kill()

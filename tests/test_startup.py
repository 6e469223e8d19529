"""The run's start-up order (startup.py): the engines and the rollout workers start before the
learner is built, so a failure in between must still stop them; and SIGTERM ends a CLI run as
Ctrl-C does (every started process stopped, the rows so far kept)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import asyncrl.run as run_module
from asyncrl.engine.fleet import EngineFleet
from asyncrl.startup import WorkerStart
from tests.test_e2e import shrunk, shrunk_overrides

ROOT = Path(__file__).resolve().parents[1]


def _wait_for(condition, deadline_s: float, what: str) -> None:
    """Poll `condition` (a cheap check of another process's state) until true or the deadline."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_a_failed_learner_build_stops_the_engines_and_workers_started_before_it(
    tiny_model, tmp_path, monkeypatch
):
    seen: dict[str, object] = {}
    spawn, start = EngineFleet.spawn, WorkerStart.__init__

    def spy_spawn(fleet, *args, **kwargs):
        seen["fleet"] = fleet
        return spawn(fleet, *args, **kwargs)

    def spy_start(workers, *args, **kwargs):
        seen["workers"] = workers
        return start(workers, *args, **kwargs)

    def failing_build(*args, **kwargs):
        pool = seen["workers"].pool()  # the workers' start is under way: let it finish first
        seen["actors"] = list(pool.workers)
        raise RuntimeError("learner build failed")

    monkeypatch.setattr(EngineFleet, "spawn", spy_spawn)
    monkeypatch.setattr(WorkerStart, "__init__", spy_start)
    monkeypatch.setattr(run_module, "build_learner", failing_build)
    with pytest.raises(RuntimeError, match="learner build failed"):
        run_module.run(shrunk(tiny_model, tmp_path))
    handles = seen["fleet"].handles
    assert handles and all(h.proc.poll() is not None for h in handles)  # engines stopped
    import ray

    for actor in seen["actors"]:  # rollout workers killed
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.pid.remote(), timeout=30)


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2] != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_sigterm_ends_a_cli_run_in_order(tiny_model, tmp_path):
    overrides = shrunk_overrides(
        tiny_model, tmp_path, "max_steps=100000", "logging.eval_interval=0"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "run", *overrides],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    try:
        _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 180,
                  "the run's first trained steps")  # fmt: skip
        started = _descendants(proc.pid)  # engine server, Ray's processes, rollout workers
        assert started
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    _wait_for(lambda: not any(_alive(p) for p in started), 60, "the run's processes to stop")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert any(r.get("version") for r in rows)  # the trained steps' rows were kept
    assert (tmp_path / "summary.json").exists()  # the logger closed: the run unwound in order

"""The run's start-up order (startup.py): the engines and the rollout workers start before the
learner is built, so a failure in between must still stop them; and SIGTERM ends a CLI run as
Ctrl-C does (every started process stopped, the rows so far kept)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import asyncrl.run as run_module
from asyncrl.engine.fleet import EngineFleet
from asyncrl.startup import WorkerStart
from tests.helpers import descendants, running, wait_for
from tests.test_e2e import shrunk, shrunk_overrides

ROOT = Path(__file__).resolve().parents[1]


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
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2,
                 "the run's first trained steps", 180)  # fmt: skip
        started = descendants(proc.pid) - {proc.pid}  # engine server, Ray's, rollout workers
        assert started
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for(lambda: not any(running(p) for p in started), "the run's processes to stop", 60)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert any(r.get("version") for r in rows)  # the trained steps' rows were kept
    assert (tmp_path / "summary.json").exists()  # the logger closed: the run unwound in order

"""Faults in the real loop: kill -9 an engine server and a rollout actor mid-run; the run
completes and no group is lost or trained twice (ids checked against the prompt stream)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

from asyncrl.checkpoint import load_msgpack
from asyncrl.run import run
from asyncrl.transport.stored import group_from_bytes
from tests.test_e2e import shrunk


def _pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _buffered_ids(extra: dict) -> list[str]:
    """Ids of the groups a checkpoint's replay queue held (stored as wire frames)."""
    return [group_from_bytes(g).group_id for g in extra["queue"]["groups"]]


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _run_engine_pid(out) -> int | None:
    """The pid of the run's own engine: the hf server whose `--port` is the one its log file
    under `out/engine_logs` is named after (never a server another test left running)."""
    logs = sorted((out / "engine_logs").glob("hf_server_*.log"))
    if not logs:
        return None
    port = logs[0].stem.rsplit("_", 1)[1]
    pids = _pids(f"asyncrl.engine.hf.server .*--port {port} ")
    return pids[0] if pids else None


def test_kill_engine_and_actor_mid_run(tiny_model, tmp_path):
    """The engine is frozen (SIGSTOP) as soon as the run has trained a step, so the run cannot
    finish on what is already generated (a tiny run trains its 20 steps in a fraction of a
    second: killing after it had finished made this test flaky); then an actor and the frozen
    engine are killed. Only healing lets the run complete."""
    steps = 20
    ray_actors = "rollout.worker_pool=ray"  # the rollout workers as processes, to kill one
    cfg = shrunk(tiny_model, tmp_path, f"max_steps={steps}", "async.max_staleness=2", ray_actors)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(summary=run(cfg)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not _rows(tmp_path / "trained_groups.jsonl") or _run_engine_pid(tmp_path) is None:
        assert time.monotonic() < deadline and thread.is_alive(), "run did not get going"
        time.sleep(0.05)
    engine = _run_engine_pid(tmp_path)
    os.kill(engine, signal.SIGSTOP)  # generation stops here: at most max_staleness steps more
    trained = len(_rows(tmp_path / "trained_groups.jsonl"))
    assert trained < steps - 4, f"the run trained {trained} steps before the engine froze"
    actors = _pids("_RayRolloutWorker")
    assert actors
    os.kill(actors[0], signal.SIGKILL)
    os.kill(engine, signal.SIGKILL)
    thread.join(timeout=600)
    assert "summary" in result, "the run did not complete"

    rows = [r for r in _rows(tmp_path / "metrics.jsonl") if r.get("version") is not None]
    assert rows[-1]["version"] == steps
    assert rows[-1]["engines/engine_restarts"] >= 1
    assert rows[-1]["rollout/actor_failures"] + rows[-1]["rollout/failed_prompts"] >= 1

    trained = [i for r in _rows(tmp_path / "trained_groups.jsonl") for i in r["ids"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    extra = load_msgpack(tmp_path / "checkpoints" / f"step_{steps}" / "extra.msgpack")
    issued = {f"e0-i{i}" for i in range(extra["prompts"]["index"])}
    buffered = set(_buffered_ids(extra))
    outstanding = {item["key"] for item in extra["outstanding"]}
    evicted = set(extra["queue"].get("evicted_ids", []))
    lost = issued - set(trained) - buffered - outstanding - evicted
    assert not lost, f"groups lost: {sorted(lost)}"

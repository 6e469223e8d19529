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


def _pids(pattern: str, parent: int | None = None) -> list[int]:
    cmd = ["pgrep", "-f", pattern] + (["-P", str(parent)] if parent else [])
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _buffered_ids(extra: dict) -> list[str]:
    """Ids of the groups a checkpoint's replay queue held (stored as wire frames)."""
    return [group_from_bytes(g).group_id for g in extra["queue"]["groups"]]


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_kill_engine_and_actor_mid_run(tiny_model, tmp_path):
    cfg = shrunk(tiny_model, tmp_path, "max_steps=8", "async.max_staleness=2")
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(summary=run(cfg)), daemon=True)
    stale = set(_pids("asyncrl.engine.hf.server", parent=os.getpid()))  # earlier tests' leftovers
    thread.start()
    deadline = time.monotonic() + 300
    while len(_rows(tmp_path / "trained_groups.jsonl")) < 2:
        assert time.monotonic() < deadline and thread.is_alive(), "run did not get going"
        time.sleep(0.2)
    # this run's engines only: a server an earlier test left under this process is not one
    engines = [p for p in _pids("asyncrl.engine.hf.server", parent=os.getpid()) if p not in stale]
    actors = _pids("_RayRolloutWorker")
    assert engines and actors
    os.kill(engines[0], signal.SIGKILL)
    os.kill(actors[0], signal.SIGKILL)
    thread.join(timeout=600)
    assert "summary" in result, "the run did not complete"

    rows = [r for r in _rows(tmp_path / "metrics.jsonl") if r.get("version") is not None]
    assert rows[-1]["version"] == 8
    assert rows[-1]["engines/engine_restarts"] >= 1
    assert rows[-1]["rollout/actor_failures"] + rows[-1]["rollout/failed_prompts"] >= 1

    trained = [i for r in _rows(tmp_path / "trained_groups.jsonl") for i in r["ids"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    extra = load_msgpack(tmp_path / "checkpoints" / "step_8" / "extra.msgpack")
    issued = {f"e0-i{i}" for i in range(extra["prompts"]["index"])}
    buffered = set(_buffered_ids(extra))
    outstanding = {item["key"] for item in extra["outstanding"]}
    evicted = set(extra["queue"].get("evicted_ids", []))
    lost = issued - set(trained) - buffered - outstanding - evicted
    assert not lost, f"groups lost: {sorted(lost)}"

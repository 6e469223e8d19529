"""Resume: stop after step k, resume → step k+1 with the same version, data position and queue
contents; nothing buffered or in flight at the stop is lost, nothing is trained twice."""

from __future__ import annotations

import json

from asyncrl.checkpoint import load_msgpack
from asyncrl.run import run
from asyncrl.transport.stored import group_from_bytes
from tests.test_e2e import shrunk


def _buffered_ids(extra: dict) -> list[str]:
    """Ids of the groups a checkpoint's replay queue held (stored as wire frames)."""
    return [group_from_bytes(g).group_id for g in extra["queue"]["groups"]]


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_stop_and_resume(tiny_model, tmp_path):
    common = ("async.max_staleness=2", "rollout.max_inflight_prompts=3")
    run(shrunk(tiny_model, tmp_path, "max_steps=2", *common))
    saved = load_msgpack(tmp_path / "checkpoints" / "step_2" / "extra.msgpack")
    assert saved["version"] == 2
    buffered = _buffered_ids(saved)
    outstanding = [item["key"] for item in saved["outstanding"]]
    first_run = [i for r in _rows(tmp_path / "trained_groups.jsonl") for i in r["ids"]]

    run(shrunk(tiny_model, tmp_path, "max_steps=4", "actor.checkpoint.resume=auto", *common))
    rows = [r for r in _rows(tmp_path / "metrics.jsonl") if r.get("version") is not None]
    resumed = [r for r in rows if r["step"] > 2]
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["version"] for r in resumed] == [3, 4]  # the version continued from 2
    steps = [r["step"] for r in _rows(tmp_path / "metrics.jsonl")]
    assert steps == sorted(set(steps)), "a step was logged twice across the resume"

    trained = [i for r in _rows(tmp_path / "trained_groups.jsonl") for i in r["ids"]]
    assert len(trained) == len(set(trained)), "a group was trained twice across the resume"
    second_run = trained[len(first_run) :]
    final = load_msgpack(tmp_path / "checkpoints" / "step_4" / "extra.msgpack")
    still_here = set(_buffered_ids(final))
    still_here |= {item["key"] for item in final["outstanding"]}
    still_here |= set(final["queue"]["evicted_ids"])
    # every group buffered or in flight at the stop was trained after the resume (or is still
    # buffered / in flight / evicted as too stale): nothing was lost
    for key in buffered + outstanding:
        assert key in second_run or key in still_here, key
    # the data position continued: the second run issued no key the first run had issued,
    # except the re-issued in-flight ones
    position = saved["prompts"]["index"]
    for key in second_run:
        index = int(key.split("-i")[1])
        assert index >= position or key in buffered + outstanding, key

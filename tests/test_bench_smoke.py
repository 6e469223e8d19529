"""Every `asyncrl bench <what>` runs at CI size (`--smoke`) through the CLI, and writes its result.

Results go to a temporary folder; baselines are read, never written. Only the figures' shape is
checked: speed targets are judged by the full benches, never by a timed unit test.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from asyncrl.cli import main

BENCH = Path(__file__).resolve().parent.parent / "bench"
OURS = ["importance", "weight-sync", "rollout", "train", "e2e", "simulate", "staleness"]
OURS += ["eval-idle", "memory", "shape"]


def _finite_headline(result: dict) -> None:
    assert result["smoke"] is True and result["headline"]
    for name, entry in result["headline"].items():
        assert math.isfinite(entry["value"]), name
    assert isinstance(result["regressions"], list)


@pytest.mark.parametrize("what", OURS)
def test_bench_smoke(what, tmp_path):
    assert main(["bench", what, "--smoke", "--out", str(tmp_path)]) == 0
    name = what.replace("-", "_")
    result = json.loads((tmp_path / f"{name}.json").read_text())
    _finite_headline(result)
    assert (tmp_path / f"{name}.png").stat().st_size > 0


@pytest.mark.slow
def test_bench_premise_smoke(tmp_path):
    """Two real `asyncrl run`s of 4 steps each (minutes on a loaded 2-core box: slow)."""
    assert main(["bench", "premise", "--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "premise.json").read_text())
    _finite_headline(result)
    assert [r["variant"] for r in result["rows"]] == ["sync", "stale_uncorrected"]
    assert (
        result["rows"][0]["staleness"] == 0 and "uncorrected_vs_sync_points" in result["verdicts"]
    )


def test_bench_transport_smoke(tmp_path):
    """Smoke: quick, no Ray, one trial; all three sizes still measured."""
    assert main(["bench", "transport", "--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "transport.json").read_text())
    _finite_headline(result)
    assert [r["tokens"] for r in result["rows"]] == [1024, 4096, 16384]
    assert all(r["codec_zmq"]["groups_per_s"] > 0 for r in result["rows"])
    # the target: per shipped recipe, the transport's CPU against the engine's generation time
    recipes = result["per_recipe"]["rows"]
    assert {r["recipe"] for r in recipes} >= {
        "default.yaml",
        "qwen2.5-7b-math-sglang-megatron.yaml",
    }
    assert all(0 < r["ratio"] < 1 for r in recipes) and "vs_raw_zmq" not in result["targets"]


def test_bench_codec_choice_smoke():
    """codec-choice writes only its tracked result file: restored afterwards."""
    path = BENCH / "results" / "codec_choice.json"
    before = path.read_bytes() if path.exists() else None
    try:
        assert main(["bench", "codec-choice", "--smoke"]) == 0
        assert json.loads(path.read_text())["chosen"] in ("msgspec", "msgpack")
    finally:
        if before is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(before)


def test_unknown_bench_and_helpers_are_refused(capsys):
    assert main(["bench", "no-such-bench"]) == 2
    assert main(["bench", "common"]) == 2
    lists = [line.split("available:")[1] for line in capsys.readouterr().out.splitlines()]
    assert len(lists) == 2 and all("'e2e'" in x and "'common'" not in x for x in lists)


def test_baseline_regressions_are_flagged(tmp_path):
    sys.path.insert(0, str(BENCH))
    import common

    baseline = {"smoke": False, "headline": {
        "speed": common.headline(100.0, True), "latency": common.headline(10.0, False),
    }}  # fmt: skip
    ok = {"smoke": False, "headline": {
        "speed": common.headline(90.0, True), "latency": common.headline(11.0, False),
    }}  # fmt: skip
    bad = {"smoke": False, "headline": {
        "speed": common.headline(50.0, True), "latency": common.headline(20.0, False),
    }}  # fmt: skip
    assert common.compare(ok, baseline, 0.25) == []
    flagged = common.compare(bad, baseline, 0.25)
    assert [line.split(":")[0] for line in flagged] == ["speed", "latency"]


def test_a_baseline_of_another_device_is_not_compared(tmp_path, capsys):
    """A GPU's result against the CPU's baseline (or another GPU's) is skipped, not flagged:
    the same bench's ratios differ by device. The same device is compared as before."""
    import argparse
    import json

    sys.path.insert(0, str(BENCH))
    import common

    cpu = {"smoke": False, "machine": {"cpus": 2}, "headline": {"x": common.headline(3.0)}}
    (tmp_path / "b.json").write_text(json.dumps(cpu))
    args = argparse.Namespace(baseline_dir=tmp_path, tolerance=0.25)
    worse = {"smoke": False, "headline": {"x": common.headline(1.0)}}
    on_gpu = {**worse, "machine": {"cpus": 16, "gpu": "NVIDIA H200"}}
    assert common._baseline_check("b", on_gpu, args) == []
    assert "measured on the CPU, this run on NVIDIA H200; skipped" in capsys.readouterr().out
    (tmp_path / "b.json").write_text(json.dumps({**cpu, "machine": {"gpu": "NVIDIA H100"}}))
    assert common._baseline_check("b", on_gpu, args) == []
    h100 = {**on_gpu, "machine": {"gpu": "NVIDIA H100"}}
    assert len(common._baseline_check("b", h100, args)) == 1
    (tmp_path / "b.json").write_text(json.dumps(cpu))
    assert len(common._baseline_check("b", {**worse, "machine": {"cpus": 2}}, args)) == 1


def test_a_headline_key_the_baseline_lacks_is_flagged_not_skipped():
    sys.path.insert(0, str(BENCH))
    import common

    baseline = {"smoke": False, "headline": {"speed": common.headline(100.0)}}
    result = {"smoke": False, "headline": {
        "speed": common.headline(100.0), "new_ratio": common.headline(0.5),
    }}  # fmt: skip
    (line,) = common.compare(result, baseline, 0.25)
    assert line.startswith("new_ratio:") and "no baseline value" in line


def test_a_full_run_appends_its_history_record(tmp_path):
    """`finish` writes the result and appends one history line naming date, command, machine
    (CPU model or GPU), commit and every headline figure; a smoke run appends none."""
    import argparse
    import json

    sys.path.insert(0, str(BENCH))
    import common

    def run(smoke: bool) -> None:
        args = argparse.Namespace(
            out=tmp_path, smoke=smoke, baseline_dir=tmp_path / "none", tolerance=0.25,
            record_baseline=False, strict=False,
        )  # fmt: skip
        result = {"headline": {"x": common.headline(2.5)}, "met": {"x": True}}
        assert common.finish("demo", result, args, argv=["--rounds", "1"]) == 0

    run(smoke=False)
    run(smoke=True)
    (line,) = (tmp_path / "history.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["bench"] == "demo" and record["figures"] == {"x": 2.5}
    assert record["command"] == "asyncrl bench demo --rounds 1" and record["met"] == {"x": True}
    assert record["machine"] and record["date"] and "commit" in record
    assert json.loads((tmp_path / "demo.json").read_text())["machine"]["cpu_model"]


def _listed(text: str) -> dict[str, str]:
    """`name  first docstring line` rows of the bench listing."""
    rows = [line.split(None, 1) for line in text.splitlines() if line.startswith("  ")]
    return {row[0]: row[1] for row in rows if len(row) == 2}


def test_bench_help_and_bare_bench_list_every_bench(capsys):
    import ast

    expected = {
        p.stem.replace("_", "-"): ast.get_docstring(ast.parse(p.read_text())).splitlines()[0]
        for p in BENCH.glob("*.py")
        if p.stem != "common" and not p.stem.startswith("_")  # `_*.py`: parts of a bench
    }
    assert "train" in expected and "-train-scale" not in expected
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    listed = _listed(capsys.readouterr().out)
    assert {k: listed.get(k) for k in expected} == expected
    assert "-train-scale" not in listed  # a bench's helper module is not a bench
    assert main(["bench"]) == 2
    assert {k: v for k, v in _listed(capsys.readouterr().out).items() if k in expected} == expected

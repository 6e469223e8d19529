"""Metrics: JSONL / TensorBoard / W&B sinks, console view, end-of-run plots and summary."""

from __future__ import annotations

import io
import json
import math
import sys
import time
import types
from pathlib import Path

import pytest

from asyncrl.config.schema import LoggingConfig
from asyncrl.metrics import History, MetricsError, MetricsLogger, report_from_jsonl
from asyncrl.metrics.console import binned, sparkline
from asyncrl.metrics.deferred import DeferredRows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def cfg(**kw) -> LoggingConfig:
    kw.setdefault("tensorboard", False)
    return LoggingConfig(**kw)


def rows(path: Path) -> list[dict]:
    def strict(token: str):
        raise AssertionError(f"non-standard JSON constant {token}")

    return [json.loads(line, parse_constant=strict) for line in path.read_text().splitlines()]


def step_metrics(s: int) -> dict[str, float]:
    m = {
        "version": s,
        "rollout/reward_mean": 0.1 + 0.02 * s,
        "replay/depth": 4,
        "throughput/tokens_per_s": 1000.0 + s,
        "learner/idle_frac": 0.25,
        "sync/seconds": 0.5,
        "mismatch/mismatch_kl": 2e-3,
        "mismatch/rollout_is_eff_sample_size": 0.95,
        "replay/staleness_mean": 0.5,
        "replay/staleness_max": 2,
        "replay/taken": 4 * s,
        "replay/evicted": s // 10,
    }
    if s % 5 == 0:
        m["eval/accuracy"] = 0.30 + s / 100
    return m


def test_jsonl_one_row_per_step_nan_as_null_flushed(tmp_path):
    logger = MetricsLogger(tmp_path, cfg(), stream=io.StringIO())
    logger.log(1, {"rollout/reward_mean": 0.5, "loss": math.nan})
    logger.log(2, {"rollout/reward_mean": math.inf, "step": 2})
    # Written and flushed by the writer thread, unasked: readable before close (and at once
    # after `flush()`, which the loop calls before a checkpoint).
    deadline = time.monotonic() + 30
    while len((tmp_path / "metrics.jsonl").read_text().splitlines()) < 2:
        assert time.monotonic() < deadline, "rows not written within 30 s"
        time.sleep(0.01)
    got = rows(tmp_path / "metrics.jsonl")
    logger.close()
    assert [r["step"] for r in got] == [1, 2]
    assert got[0]["rollout/reward_mean"] == 0.5 and got[0]["loss"] is None
    assert got[1]["rollout/reward_mean"] is None
    assert all(isinstance(r["time"], float) and r["timestamp"] > 1e9 for r in got)
    assert got[0]["time"] <= got[1]["time"]


def test_tensorboard_events_written(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    logger = MetricsLogger(tmp_path, cfg(tensorboard=True), stream=io.StringIO())
    logger.log(3, {"rollout/reward_mean": 0.25})
    logger.close()
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    events = list(LegacyEventFileLoader(str(files[0])).Load())
    scalars = [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value]
    assert scalars == [(3, "rollout/reward_mean", 0.25)]


def test_console_prints_step_line_when_not_a_tty(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, cfg(plots=False), {"max_steps": 5}, stream=out)
    logger.log(3, {"version": 3, "rollout/reward_mean": 0.5}, staleness_hist={0: 6, 1: 2})
    logger.close()
    line = out.getvalue().splitlines()[0]
    assert line.startswith("step 3/5  version 3  reward 0.500")
    assert "eval acc -" in line and "kl -" in line  # missing metrics shown as "-"
    assert "0:6 1:2" in line


def test_console_live_view_on_a_tty(tmp_path):
    out = TTY()
    logger = MetricsLogger(tmp_path, cfg(plots=False), stream=out, run_name="demo")
    for s in (1, 2):
        logger.log(s, {"eval/accuracy": 0.4}, staleness_hist={0: 3, 1: 1})
    logger.close()
    text = out.getvalue()
    assert "asyncrl · demo" in text and "40.0%" in text and "k=1" in text
    assert "step 2  " not in text  # the live table, not the step line


def test_console_false_still_prints_lines_even_on_a_tty(tmp_path):
    out = TTY()
    logger = MetricsLogger(tmp_path, cfg(console=False, plots=False), stream=out)
    logger.log(1, {"version": 0})
    logger.close()
    assert out.getvalue().startswith("step 1  version 0")


def test_synthetic_20_step_run_plots_and_summary(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, cfg(tensorboard=True), {"max_steps": 20}, stream=out)
    for s in range(1, 21):
        logger.log(s, step_metrics(s), staleness_hist={0: 3, 2: 1})
    summary = logger.close()
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["reward_accuracy.png", "staleness_hist.png", "throughput.png"]
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in logger.plot_files)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == summary
    assert summary["steps"] == 20 and summary["last_step"] == 20
    assert summary["eval_first"] == pytest.approx(0.35)
    assert summary["eval_best"] == summary["eval_last"] == pytest.approx(0.50)
    assert summary["eval_gain_points"] == pytest.approx(15.0)
    assert summary["reward_first"] == pytest.approx(0.16)
    assert summary["reward_last"] == pytest.approx(0.46)
    assert summary["tokens_per_s_mean"] == pytest.approx(1010.5)
    assert summary["learner_idle_pct"] == pytest.approx(25.0)
    assert summary["sync_seconds_mean"] == pytest.approx(0.5)
    assert summary["groups_trained"] == 80 and summary["groups_evicted"] == 2
    assert summary["mismatch_kl_mean"] == pytest.approx(2e-3)
    assert summary["staleness_hist"] == {"0": 60, "2": 20}
    assert "+15.0 points" in out.getvalue()  # the printed summary table


@pytest.mark.parametrize("n_steps", [0, 1])
def test_empty_and_one_step_runs(tmp_path, n_steps):
    logger = MetricsLogger(tmp_path, cfg(tensorboard=True), stream=io.StringIO())
    for s in range(n_steps):
        logger.log(s, {"rollout/reward_mean": 1.0, "eval/accuracy": 0.5})
    summary = logger.close()
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["steps"] == n_steps
    assert summary["tokens_per_s_mean"] is None and summary["groups_trained"] is None
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    if n_steps == 0:
        assert plots == [] and summary["eval_gain_points"] is None
    else:
        assert plots == ["reward_accuracy.png"] and summary["eval_gain_points"] == 0.0


def test_plots_false_writes_no_report_but_returns_summary(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, cfg(plots=False), stream=out)
    logger.log(1, {"rollout/reward_mean": 0.5})
    summary = logger.close()
    assert summary["reward_last"] == 0.5 and logger.close() is summary
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "plots").exists()
    with pytest.raises(MetricsError, match="after close"):
        logger.log(2, {})


def test_wandb_requested_but_missing_is_one_line_naming_wandb(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb → ImportError
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time": 0.0}\n')
    with pytest.raises(MetricsError) as info:
        MetricsLogger(tmp_path, cfg(wandb_project="proj"), stream=io.StringIO())
    message = str(info.value)
    assert "\n" not in message and "`wandb`" in message and "wandb_project" in message
    # Failed before touching the run's files.
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "time": 0.0}\n'


def test_wandb_sink_logs_and_finishes(tmp_path, monkeypatch):
    calls: list[tuple] = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw["project"], kw["name"], kw["config"]))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    logger = MetricsLogger(
        tmp_path,
        cfg(wandb_project="p", plots=False),
        {"lr": 1.0},
        run_name="r",
        stream=io.StringIO(),
    )
    logger.log(7, {"rollout/reward_mean": 0.5})
    logger.close()
    assert calls == [
        ("init", "p", "r", {"lr": 1.0}),
        ("log", 7, {"rollout/reward_mean": 0.5}),
        ("finish",),
    ]


@pytest.mark.parametrize(
    ("step", "metrics", "match"),
    [
        (1, {"rollout/reward_mean": "high"}, "'rollout/reward_mean' at step 1"),
        (1, {"time": 3.0}, "reserved"),
        (-1, {}, "step must be an int"),
        (1.5, {}, "step must be an int"),
        (1, {3: 1.0}, "key 3"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, step, metrics, match):
    with MetricsLogger(tmp_path, cfg(plots=False), stream=io.StringIO()) as logger:
        with pytest.raises(MetricsError, match=match):
            logger.log(step, metrics)
        with pytest.raises(MetricsError, match="bin -1"):
            logger.log(1, {}, staleness_hist={-1: 2})


def test_same_step_merges_and_resume_rewinds(tmp_path):
    first = MetricsLogger(tmp_path, cfg(plots=False), stream=io.StringIO())
    for s in range(1, 6):
        first.log(s, {"rollout/reward_mean": float(s)}, staleness_hist={0: 1})
    first.log(5, {"eval/accuracy": 0.5})  # eval of the same step: merged, not a new step
    assert first.close()["steps"] == 5
    # Resume from a checkpoint at step 3: steps 4 and 5 run again.
    second = MetricsLogger(tmp_path, cfg(), append=True, stream=io.StringIO())
    for s in range(4, 7):
        second.log(s, {"rollout/reward_mean": 10.0 * s}, staleness_hist={1: 1})
    summary = second.close()
    assert summary["steps"] == 6 and summary["eval_count"] == 0
    assert summary["reward_last"] == pytest.approx((2 + 3 + 40 + 50 + 60) / 5)
    assert summary["staleness_hist"] == {"0": 3, "1": 3}
    got = rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 5, 4, 5, 6]
    assert got[6]["time"] >= got[5]["time"]  # the clock continues across the resume


def test_report_from_jsonl_skips_a_torn_last_line(tmp_path):
    lines = [
        json.dumps({"step": s, "time": float(s), "throughput/tokens_per_s": 100.0 * s})
        for s in (1, 2)
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "ti')
    summary = report_from_jsonl(tmp_path)
    assert summary["steps"] == 2 and summary["tokens_per_s_mean"] == 150.0
    assert [p.name for p in (tmp_path / "plots").iterdir()] == ["throughput.png"]
    (tmp_path / "metrics.jsonl").write_text("not json\n" + lines[0] + "\n")
    with pytest.raises(MetricsError, match="metrics.jsonl:1"):
        report_from_jsonl(tmp_path)


def test_cumulative_lag_taken_histogram_when_no_per_step_one():
    history = History()
    history.add(1, 0.0, {"replay/lag_taken/0": 4, "replay/lag_taken/1": 1})
    history.add(2, 1.0, {"replay/lag_taken/0": 7, "replay/lag_taken/1": 3})
    assert history.staleness_hist() == {0: 7, 1: 3}
    history.add(3, 2.0, {"replay/staleness_hist/2": 5})
    assert history.staleness_hist() == {2: 5}  # per-step counts win


def test_histogram_text_helpers():
    assert binned({}) == []
    assert binned({0: 3, 2: 1}) == [("0", 3), ("1", 0), ("2", 1)]
    assert binned({0: 1, 7: 2, 20: 3}, max_bins=8)[-1] == ("≥7", 5)
    assert sparkline([8, 0, 1]) == "█ ▁" and sparkline([0, 0]) == ""


def test_resume_purges_tensorboard_events_after_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    from asyncrl.metrics.rundir import purge_tensorboard

    def scalars(folder: Path) -> list[tuple[int, float]]:
        return sorted(
            (e.step, v.simple_value)
            for f in folder.glob("events.out.tfevents.*")
            for e in LegacyEventFileLoader(str(f)).Load()
            for v in e.summary.value
        )

    with MetricsLogger(tmp_path, cfg(tensorboard=True, plots=False), stream=io.StringIO()) as log:
        for s in range(1, 6):
            log.log(s, {"rollout/reward_mean": float(s)})
    logdir = tmp_path / "tensorboard"
    assert not purge_tensorboard(logdir, 5, tmp_path / "aside")  # nothing after step 5
    assert purge_tensorboard(logdir, 3, tmp_path / "aside")
    assert scalars(logdir) == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert scalars(tmp_path / "aside") == [(s, float(s)) for s in range(1, 6)]  # kept aside
    # the resumed run's steps follow without a second series for steps 4 and 5
    resumed = MetricsLogger(tmp_path, cfg(tensorboard=True, plots=False), append=True)
    with resumed:
        resumed.log(4, {"rollout/reward_mean": 40.0})
    assert scalars(logdir) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_deferred_rows_wait_for_their_evaluation_and_keep_step_order():
    logged: list[tuple[int, dict]] = []

    class Log:
        def elapsed(self) -> float:
            return 0.0

        def log(self, step: int, metrics: dict, *, at: float | None = None) -> None:
            logged.append((step, dict(metrics)))

    rows = DeferredRows(Log())
    rows.add(0, {})
    rows.flush(held={0})  # step 0's evaluation still runs: nothing is written
    rows.add(1, {"version": 1.0})
    rows.flush(held={0})
    assert logged == []
    rows.land([(0, {"eval/accuracy": 0.25})])
    rows.add(2, {"version": 2.0})
    rows.flush(held={2})  # 0 and 1 go, in order; 2 waits for its own evaluation
    assert logged == [(0, {"eval/accuracy": 0.25}), (1, {"version": 1.0})]
    rows.flush(held=())  # its evaluation failed: the row goes without it
    assert logged[-1] == (2, {"version": 2.0})
    with pytest.raises(ValueError, match="no pending row"):
        rows.land([(1, {"eval/accuracy": 0.5})])  # written already
    with pytest.raises(ValueError, match="step 2 after step 3"):
        rows.add(3, {})
        rows.add(2, {})


def test_a_held_row_keeps_the_time_its_step_ended(tmp_path, monkeypatch):
    """Rows held for their evaluation are written later, all at once: their `time` must still
    be when their step ended, or throughput-over-time plots fold back on themselves."""
    logger = MetricsLogger(tmp_path, cfg(plots=False, console=False))
    clock = iter([1.0, 2.0, 9.0, 9.5])
    monkeypatch.setattr(logger, "elapsed", lambda: next(clock))
    with logger:
        held = DeferredRows(logger)
        held.add(1, {"version": 1.0})  # ends at 1.0
        held.add(2, {"version": 2.0})  # ends at 2.0
        held.flush(held=())  # written later (the clock would say 9.0, 9.5)
    assert [(r["step"], r["time"]) for r in rows(tmp_path / "metrics.jsonl")] == [
        (1, 1.0),
        (2, 2.0),
    ]

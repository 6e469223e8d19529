"""MetricsLogger: what the training loop calls once per optimizer step, and at the end.

logger = MetricsLogger(output_dir, cfg.logging, run_config, max_steps=cfg.max_steps)
logger.log(step, {"rollout/reward_mean": 0.4, ...})   # key conventions: metrics/keys.py
summary = logger.close()                              # plots, summary.json, summary table
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from asyncrl.metrics import keys
from asyncrl.metrics.console import make_console
from asyncrl.metrics.history import History, MetricsError
from asyncrl.metrics.plots import write_plots
from asyncrl.metrics.sinks import JsonlSink, Sink, TensorBoardSink, WandbSink
from asyncrl.metrics.summary import print_summary, summarize

if TYPE_CHECKING:
    from asyncrl.config.schema import LoggingConfig

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_DIR = "plots"
TENSORBOARD_DIR = "tensorboard"


def _as_float(step: int, key: Any, value: Any) -> float:
    if not isinstance(key, str) or not key:
        raise MetricsError(f"metrics at step {step}: key {key!r} is not a non-empty string")
    try:
        return float(value)  # python and numpy numbers, 0-d tensors
    except (TypeError, ValueError):
        raise MetricsError(f"metric {key!r} at step {step}: {value!r} is not a number") from None


def clean_metrics(
    step: int, metrics: Mapping[str, Any], staleness_hist: Mapping[int, int] | None = None
) -> dict[str, float]:
    """Checked python floats; `staleness_hist` becomes `replay/staleness_hist/<k>` keys.
    A `step` key equal to the step is dropped; the JSONL row's own keys are refused."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise MetricsError(f"metrics: step must be an int >= 0, got {step!r}")
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key == "step" and _as_float(step, key, value) == step:
            continue
        if key in keys.RESERVED:
            raise MetricsError(f"metrics at step {step}: key {key!r} is reserved for the row")
        out[key] = _as_float(step, key, value)
    for k, n in (staleness_hist or {}).items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise MetricsError(f"staleness_hist at step {step}: bin {k!r} is not an int >= 0")
        out[f"{keys.STALENESS_HIST}{k}"] = _as_float(step, f"staleness_hist[{k}]", n)
    return out


def write_report(
    output_dir: Path, history: History, wall_time_s: float, stream: IO[str] | None
) -> tuple[dict[str, Any], list[Path]]:
    """summary.json, the PNG plots, and the summary table on `stream` (None: not printed).
    summary.json is written first so a plotting failure cannot lose it."""
    summary = summarize(history, wall_time_s)
    text = json.dumps(summary, indent=2, allow_nan=False)
    (output_dir / SUMMARY_FILE).write_text(text + "\n", encoding="utf-8")
    plots = write_plots(history, output_dir / PLOT_DIR)
    if stream is not None:
        print_summary(summary, stream, title=f"run summary · {output_dir}")
    return summary, plots


def report_from_jsonl(output_dir: Path, stream: IO[str] | None = None) -> dict[str, Any]:
    """Redraw the plots and summary of a run from its `metrics.jsonl` (e.g. after a crash)."""
    output_dir = Path(output_dir)
    history = History.from_jsonl(output_dir / METRICS_FILE)
    return write_report(output_dir, history, history.last_time, stream)[0]


class MetricsLogger:
    """Composes the sinks a LoggingConfig asks for: JSONL (always), TensorBoard, W&B, and the
    console (a live view on a terminal when `cfg.console`, else one line per step).

    `append=True` (resume) keeps the existing `metrics.jsonl`, reads it back so plots and the
    summary cover the whole run, and continues its clock; otherwise the file is replaced.
    `max_steps` (else `run_config["max_steps"]`) is only shown as `step k/max_steps`.
    """

    def __init__(
        self,
        output_dir: Path,
        cfg: LoggingConfig,
        run_config: dict | None = None,
        *,
        run_name: str | None = None,
        max_steps: int | None = None,
        append: bool = False,
        stream: IO[str] | None = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.run_name = run_name or self.output_dir.name
        if max_steps is None and run_config:
            max_steps = run_config.get("max_steps")
        self._stream = stream if stream is not None else sys.stdout
        metrics_path = self.output_dir / METRICS_FILE
        self.history = History.from_jsonl(metrics_path) if append else History()
        self._offset = self.history.last_time
        self._start = time.perf_counter()
        self._now = self._offset
        self.summary: dict[str, Any] | None = None
        self.plot_files: list[Path] = []
        self._sinks = self._open_sinks(metrics_path, run_config, max_steps, append)

    def _open_sinks(
        self, metrics_path: Path, run_config: dict | None, max_steps: int | None, append: bool
    ) -> list[Sink]:
        sinks: list[Sink] = []
        try:
            # W&B first: a missing package must fail before any file of the run is replaced.
            if self.cfg.wandb_project:
                sinks.append(
                    WandbSink(self.cfg.wandb_project, self.run_name, run_config, self.output_dir)
                )
            sinks.append(JsonlSink(metrics_path, clock=lambda: self._now, append=append))
            if self.cfg.tensorboard:
                sinks.append(TensorBoardSink(self.output_dir / TENSORBOARD_DIR))
            title = f"asyncrl · {self.run_name}"
            sinks.append(
                make_console(self.history, self._stream, max_steps, self.cfg.console, title)
            )
        except BaseException:
            for sink in sinks:
                sink.close()
            raise
        return sinks

    def elapsed(self) -> float:
        """Seconds since the run started (resumed runs continue the earlier clock)."""
        return self._offset + time.perf_counter() - self._start

    def log(
        self,
        step: int,
        metrics: Mapping[str, Any],
        staleness_hist: Mapping[int, int] | None = None,
        at: float | None = None,
    ) -> None:
        """Record one step's metrics in every sink. Non-finite values are kept (null in JSONL).
        `at`: when the step ended (`elapsed()` then; default now) — a row written later (held
        for its evaluation) keeps its step's own time."""
        if self.summary is not None:
            raise MetricsError(f"metrics: log(step={step}) after close()")
        clean = clean_metrics(step, metrics, staleness_hist)
        self._now = self.elapsed() if at is None else at
        self.history.add(step, self._now, clean)
        for sink in self._sinks:
            sink.write(step, clean)

    def flush(self) -> None:
        """Return once every row logged so far is stored by every sink (before a checkpoint:
        a resume from it keeps those rows)."""
        for sink in self._sinks:
            sink.flush()

    def close(self) -> dict[str, Any]:
        """Close every sink, then (when `cfg.plots`) write summary.json and the plots and print
        the summary table. Returns the summary; a second call returns the same summary."""
        if self.summary is not None:
            return self.summary
        wall = self.elapsed()
        error: BaseException | None = None
        for sink in self._sinks:
            try:
                sink.close()
            except Exception as exc:  # close the others; report the first failure below
                error = error or exc
        if self.cfg.plots:
            self.summary, self.plot_files = write_report(
                self.output_dir, self.history, wall, self._stream
            )
        else:
            self.summary = summarize(self.history, wall)
        if error is not None:
            raise error
        return self.summary

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

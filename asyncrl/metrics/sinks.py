"""Where metrics go: a JSONL file, TensorBoard events, W&B. One small Protocol, three sinks.

Values reaching a sink are python floats (maybe NaN or ±inf); the logger has checked them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from asyncrl.metrics.history import MetricsError


class Sink(Protocol):
    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """`metrics.jsonl`: one object per `write` with `step`, `time` (seconds since the run
    started, resumes included), `timestamp` (unix seconds) and the metrics; non-finite values
    are written as null (strict JSON). Flushed every row so a crash loses at most one line."""

    def __init__(self, path: Path, clock: Callable[[], float], append: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._clock = clock
        self._file = path.open("a" if append else "w", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row: dict[str, Any] = {"step": step, "time": round(self._clock(), 3)}
        row["timestamp"] = round(time.time(), 3)
        row.update({k: v if math.isfinite(v) else None for k, v in metrics.items()})
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars into TensorBoard event files under `logdir`, via tensorboard's own writer
    (imports in well under a second, unlike `torch.utils.tensorboard`)."""

    def __init__(self, logdir: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._writer = EventFileWriter(str(logdir), flush_secs=10)
        self.logdir = logdir

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        summary = self._summary(value=values)
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class WandbSink:
    """A W&B run in `project`; wandb is imported only here, when a project is configured."""

    def __init__(
        self, project: str, name: str | None, config: dict | None, output_dir: Path
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise MetricsError(
                f"logging.wandb_project is {project!r} but the `wandb` package is not "
                "installed: pip install wandb, or set logging.wandb_project: null"
            ) from None
        self._run = wandb.init(project=project, name=name, config=config, dir=str(output_dir))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()

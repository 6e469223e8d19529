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
from asyncrl.metrics.stream import BackgroundStream


class Sink(Protocol):
    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def flush(self) -> None:
        """Return once every row written so far is stored (a checkpoint is taken next)."""

    def close(self) -> None: ...


class JsonlSink:
    """`metrics.jsonl`: one object per `write` with `step`, `time` (seconds since the run
    started, resumes included), `timestamp` (unix seconds) and the metrics; non-finite values
    are written as null (strict JSON). The row is built here and written and flushed by a
    writer thread (`stream.BackgroundStream`): `flush()` returns once it is on disk."""

    def __init__(self, path: Path, clock: Callable[[], float], append: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._clock = clock
        file = path.open("a" if append else "w", encoding="utf-8")
        self._file = BackgroundStream(file, path.name, owns_target=True)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row: dict[str, Any] = {"step": step, "time": round(self._clock(), 3)}
        row["timestamp"] = round(time.time(), 3)
        row.update({k: v if math.isfinite(v) else None for k, v in metrics.items()})
        self._file.write(json.dumps(row, allow_nan=False) + "\n")

    def flush(self) -> None:
        self._file.drain()

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

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


#: In output_dir: the W&B run this run logs to ({"id", "project"}, plus "resume_step" once
#: `metrics/rundir.py:roll_back` cut the run back), so a resume continues that W&B run.
WANDB_RUN_FILE = "wandb_run.json"


def read_wandb_record(out: Path) -> dict[str, Any] | None:
    """The W&B run recorded in `out` (None: none, or a record this code did not write)."""
    try:
        record = json.loads((out / WANDB_RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("id"), str) else None


def _write_wandb_record(out: Path, record: dict[str, Any]) -> None:
    tmp = out / (WANDB_RUN_FILE + ".tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    tmp.replace(out / WANDB_RUN_FILE)  # atomic: a crash leaves the old record or the new


def mark_wandb_resume(out: Path, step: int) -> bool:
    """Have the next W&B sink in `out` rewind its run to `step` (the checkpoint a resume took):
    the history W&B holds past it was logged by the steps the resumed run trains again. False:
    no W&B run was recorded there."""
    record = read_wandb_record(out)
    if record is None:
        return False
    _write_wandb_record(out, {**record, "resume_step": step})
    return True


class WandbSink:
    """A W&B run in `project`; wandb is imported only here, when a project is configured.

    The run's id is recorded in `output_dir` (WANDB_RUN_FILE). A resumed run continues that W&B
    run rewound to the checkpoint's step with W&B's own rewind (`resume_from="<id>?_step=<k+1>"`,
    wandb >= 0.17.1: history from step k+1 on is archived, then logged again); where the account
    or SDK cannot rewind, a fork at that step (`fork_from`, wandb >= 0.16.5, a new run id); and
    where neither is possible, a new run, saying so in one line. Never logging into the old
    history past k: W&B drops a step it has seen (steps must increase), losing the new rows."""

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
        out = Path(output_dir)
        base = {"project": project, "name": name, "config": config, "dir": str(out)}
        self._run = _start_run(wandb, base, read_wandb_record(out))
        run_id = getattr(self._run, "id", None)  # wandb's Run has one; without, nothing to resume
        if run_id is not None:
            _write_wandb_record(out, {"id": str(run_id), "project": project})

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def flush(self) -> None:
        """W&B's own process uploads the rows: a resume rewinds its run (see above)."""

    def close(self) -> None:
        self._run.finish()


def _start_run(wandb: Any, base: dict[str, Any], record: dict[str, Any] | None) -> Any:
    """A new W&B run, the recorded one continued, or it rewound (else forked) to its
    `resume_step` (see WandbSink)."""
    if record is None:
        return wandb.init(**base)
    run_id, step = record["id"], record.get("resume_step")
    if not isinstance(step, int):  # restarted without a roll-back: nothing to cut
        return wandb.init(**base, id=run_id, resume="allow")
    at, errors = f"{run_id}?_step={step + 1}", []
    for how in ("resume_from", "fork_from"):
        try:
            run = wandb.init(**base, **{how: at})
        except Exception as e:  # noqa: BLE001 - a preview feature the account or SDK may lack
            errors.append(f"{how}: {_one_line(e)}")
            continue
        if how == "fork_from":
            print(f"asyncrl: W&B could not rewind run {run_id} ({errors[0]}); forked it at "
                  f"step {step} as run {run.id}")  # fmt: skip
        return run
    print(f"asyncrl: W&B could neither rewind nor fork run {run_id} at step {step} "
          f"({'; '.join(errors)}); logging to a new W&B run")  # fmt: skip
    return wandb.init(**base)


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

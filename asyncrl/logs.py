"""What a run shows on the console, and where everything else goes.

The console keeps asyncrl's own output: the live view, `asyncrl: ...` notices, asyncrl's
warnings, progress bars of its own long steps (`StepProgress`). Third-party chatter goes to
`output_dir/asyncrl.log` instead (`third_party_to_log`): transformers' weight-loading bars and
advisories, Python warnings (deprecations), Ray's start-up banner and notices. Child processes
(Ray actors, engine servers) inherit a quiet transformers through the environment.
`ASYNCRL_DEBUG=1` leaves everything on the console, and makes the CLI show tracebacks.
Nothing here imports a heavy module at import time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEBUG_ENV = "ASYNCRL_DEBUG"
LOG_FILE = "asyncrl.log"
# For child processes (Ray actors, engine servers), which read these when transformers and
# huggingface_hub import; a value the user set is kept.
QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def debug_enabled() -> bool:
    """`ASYNCRL_DEBUG` set to anything but empty or 0."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class _LogFile(logging.FileHandler):
    """Appends to the log file, opened (and its folder made) at the first record, which is also
    when the console is told where third-party output goes: nothing is created in output_dir
    before the run itself has looked at it, and a run that fails early prints one line."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, mode="a", encoding="utf-8", delay=True)
        self.setFormatter(logging.Formatter(_FORMAT))

    def _open(self) -> Any:
        path = Path(self.baseFilename)
        path.parent.mkdir(parents=True, exist_ok=True)
        print(
            f"asyncrl: third-party logs go to {path} ({DEBUG_ENV}=1 shows them here)",
            file=sys.stderr,
        )
        return super()._open()


@contextlib.contextmanager
def third_party_to_log(output_dir: str | Path) -> Iterator[Path | None]:
    """Inside the block, third-party logging, warnings and progress bars go to
    `output_dir/asyncrl.log` (yielded) rather than the console; everything is restored after.
    With `ASYNCRL_DEBUG=1` nothing changes and None is yielded."""
    if debug_enabled():
        yield None
        return
    path = Path(output_dir) / LOG_FILE
    handler = _LogFile(path)
    with contextlib.ExitStack() as undo:
        undo.enter_context(_root_handler(handler))
        undo.enter_context(_warnings_to_logging())
        undo.enter_context(_quiet_transformers())  # before the environment quiets it too
        undo.enter_context(_quiet_ray())
        undo.enter_context(_child_environment())
        try:
            yield path
        finally:
            handler.close()


@contextlib.contextmanager
def _child_environment() -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in QUIET_ENV}
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _root_handler(handler: logging.Handler) -> Iterator[None]:
    """The log file on the root logger, and asyncrl's own warnings kept on the console: with a
    root handler present, logging's last-resort console output no longer fires."""
    root, ours = logging.getLogger(), logging.getLogger("asyncrl")
    console = logging.StreamHandler()  # sys.stderr, looked up now
    console.setLevel(logging.WARNING)
    root.addHandler(handler)
    ours.addHandler(console)
    try:
        yield
    finally:
        ours.removeHandler(console)
        root.removeHandler(handler)


@contextlib.contextmanager
def _warnings_to_logging() -> Iterator[None]:
    """`warnings.warn` (e.g. transformers' FutureWarnings) → logger `py.warnings` → the file."""
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers logs through its own stderr handler and does not propagate: swap that for
    propagation (to the file), and turn its tqdm bars off."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        hf_logging.disable_propagation()
        hf_logging.enable_default_handler()


@contextlib.contextmanager
def _quiet_ray() -> Iterator[None]:
    """Ray gives its logger a stderr handler (not propagating) when it is imported. Importing Ray
    here to remove it would be too early: `net.init_ray` sets environment Ray reads at import.
    So the handler is detached the first time a `ray.*` record is made, from the log-record
    factory (it runs before any handler sees the record), and the records propagate to the
    file. Ray wraps the factory it finds, so ours stays in the chain, inert after the block."""
    ray_logger, detached = logging.getLogger("ray"), []
    propagate, previous, active = ray_logger.propagate, logging.getLogRecordFactory(), True

    def detach() -> None:
        for h in [h for h in ray_logger.handlers if h not in detached]:
            ray_logger.removeHandler(h)
            detached.append(h)
        ray_logger.propagate = True

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if active and record.name.split(".", 1)[0] == "ray":
            detach()
        return record

    if "ray" in sys.modules:
        detach()
    logging.setLogRecordFactory(factory)
    try:
        yield
    finally:
        active = False
        if logging.getLogRecordFactory() is factory:
            logging.setLogRecordFactory(previous)
        for h in detached:
            ray_logger.addHandler(h)
        ray_logger.propagate = False if detached else propagate  # Ray's own setting, or as found


class StepProgress:
    """Progress of a long loop on stderr: on a terminal a rich bar (steps, the fields given to
    `update` such as the loss, elapsed time, ETA); elsewhere (a pipe, a CI log) a plain line every
    10 % of the steps, since a redrawn bar is noise in a file."""

    def __init__(self, total: int, label: str, console: Any = None) -> None:
        self.total, self.label = max(1, total), label
        self._console, self._progress, self._task = console, None, None
        self._start, self._every = 0.0, max(1, self.total // 10)

    def __enter__(self) -> StepProgress:
        from rich.console import Console

        console = self._console or Console(stderr=True)
        self._start = time.perf_counter()
        if console.is_terminal:
            self._progress = _rich_progress(console)
            self._progress.start()
            self._task = self._progress.add_task(self.label, total=self.total, fields="")
        else:
            self._console = console
        return self

    def update(self, done: int, **fields: float) -> None:
        """`done` steps of `total` are finished; `fields` are shown beside the count."""
        text = "  ".join(f"{k} {v:.4g}" for k, v in fields.items())
        if self._progress is not None:
            self._progress.update(self._task, completed=done, fields=text)
        elif done % self._every == 0 or done == self.total:
            elapsed = time.perf_counter() - self._start
            eta = elapsed / max(done, 1) * (self.total - done)
            self._console.print(
                f"{self.label}: {done}/{self.total}  {text}  elapsed {_clock(elapsed)}  "
                f"eta {_clock(eta)}",
                highlight=False,
                markup=False,
            )

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


def _rich_progress(console: Any) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[fields]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
    )


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"

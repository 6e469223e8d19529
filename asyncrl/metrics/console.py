"""What a user watches while a run trains: a live rich view on a terminal, else one line per
step (CI logs, pipes, `console: false`). Both read the same fields from the run's History,
which the logger updates before it writes the sinks."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import IO

from asyncrl.metrics import keys
from asyncrl.metrics.history import History
from asyncrl.metrics.stream import BackgroundStream

MISSING = "-"
BARS = "▁▂▃▄▅▆▇█"
#: Staleness bins shown one by one; larger ones are summed into the last bin ("≥N").
MAX_BINS = 8


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return MISSING if value is None else f"{value:{spec}}{suffix}"


def _pct(value: float | None) -> str:
    return MISSING if value is None else f"{100 * value:.1f}%"


def binned(hist: Mapping[int, int], max_bins: int = MAX_BINS) -> list[tuple[str, int]]:
    """(label, count) for staleness 0..max, gaps included, the tail summed into "≥max_bins-1"."""
    if not hist:
        return []
    top = max(hist)
    if top < max_bins:
        return [(str(k), hist.get(k, 0)) for k in range(top + 1)]
    head = [(str(k), hist.get(k, 0)) for k in range(max_bins - 1)]
    tail = sum(n for k, n in hist.items() if k >= max_bins - 1)
    return [*head, (f"≥{max_bins - 1}", tail)]


def sparkline(counts: list[int]) -> str:
    """One block character per bin, height ∝ count; an empty bin is a space."""
    peak = max(counts, default=0)
    if peak <= 0:
        return ""
    return "".join(" " if n <= 0 else BARS[min(7, math.ceil(8 * n / peak) - 1)] for n in counts)


def staleness_stats(history: History) -> str:
    """`mean 0.20 max 1` of the latest step, or "-"."""
    mean = history.latest.get(keys.STALENESS_MEAN)
    peak = history.latest.get(keys.STALENESS_MAX)
    parts = [] if mean is None else [f"mean {mean:.2f}"]
    parts += [] if peak is None else [f"max {peak:.0f}"]
    return " ".join(parts) or MISSING


def staleness_text(history: History) -> str:
    """`▇▂ 0:12 1:3 mean 0.20 max 1` (run histogram, zero bins left out of the counts)."""
    bins = binned(history.staleness_hist())
    counts = " ".join(f"{label}:{n}" for label, n in bins if n)
    parts = [sparkline([n for _, n in bins]), counts] if bins else []
    stats = staleness_stats(history)
    return " ".join([*parts, *([] if stats == MISSING else [stats])]) or MISSING


def view_fields(step: int, max_steps: int | None, history: History) -> list[tuple[str, str]]:
    """(label, text) pairs of the live view and the step line: the latest value of each key,
    "-" when it never appeared, "nan"/"inf" when the latest is not finite (an alarm)."""
    latest = history.latest.get
    return [
        ("step", f"{step}/{max_steps}" if max_steps else str(step)),
        ("version", _fmt(latest(keys.VERSION), ".0f")),
        ("reward", _fmt(latest(keys.REWARD), ".3f")),
        ("eval acc", _pct(latest(keys.ACCURACY))),
        ("queue", _fmt(latest(keys.DEPTH), ".0f")),
        ("staleness", staleness_text(history)),
        ("tok/s", _fmt(latest(keys.TOKENS_PER_S), ",.0f")),
        ("idle", _pct(latest(keys.IDLE_FRAC))),
        ("sync", _fmt(latest(keys.SYNC_SECONDS), ".2f", "s")),
        ("kl", _fmt(latest(keys.MISMATCH_KL), ".2e")),
        ("ess", _fmt(latest(keys.ESS), ".3f")),
    ]


class LineConsole:
    """One compact line per step, flushed: readable in CI logs and under `tee`. The line is
    built here and written by a writer thread (`stream.BackgroundStream`: printing from the
    training thread cost it 2.5-3 ms a step); a line may thus follow by milliseconds a message
    the loop prints directly."""

    def __init__(self, history: History, stream: IO[str], max_steps: int | None) -> None:
        self._history, self._max_steps = history, max_steps
        self._stream = BackgroundStream(stream, "console")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        fields = view_fields(step, self._max_steps, self._history)
        self._stream.write("  ".join(f"{label} {text}" for label, text in fields) + "\n")

    def flush(self) -> None:
        self._stream.drain()

    def close(self) -> None:
        self._stream.close()


class LiveConsole:
    """A rich `Live` table redrawn once per step (no refresh thread: nothing changes between
    steps). Started at the first step so nothing is drawn before there is something to show."""

    def __init__(
        self, history: History, stream: IO[str], max_steps: int | None, title: str
    ) -> None:
        from rich.console import Console

        self._history, self._max_steps, self._title = history, max_steps, title
        self._console = Console(file=stream)
        self._live = None

    def _render(self, step: int):
        from rich.table import Table

        table = Table(title=self._title, show_header=False, title_justify="left")
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for label, text in view_fields(step, self._max_steps, self._history):
            if label != "staleness":
                table.add_row(label, text)
        table.add_row("staleness", staleness_stats(self._history))
        bins = binned(self._history.staleness_hist())
        peak = max((n for _, n in bins), default=0)
        for label, n in bins:
            table.add_row(f"  k={label}", "█" * (round(30 * n / peak) if peak else 0) + f" {n}")
        return table

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._live is None:
            from rich.live import Live

            self._live = Live(console=self._console, auto_refresh=False, transient=False)
            self._live.start()
        self._live.update(self._render(step), refresh=True)

    def flush(self) -> None:
        """Drawn at every `write` already."""

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


def make_console(
    history: History, stream: IO[str], max_steps: int | None, live: bool, title: str
) -> LineConsole | LiveConsole:
    """The live view when asked for and `stream` is a terminal, else the step line."""
    if live and stream.isatty():
        return LiveConsole(history, stream, max_steps, title)
    return LineConsole(history, stream, max_steps)

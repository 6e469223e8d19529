"""What a run logged, kept small: the plotted series, the staleness histogram, latest values.

Invariants: steps are non-decreasing. A row for the step already last merges into it (the loop
may log eval results separately for the same step); a row for an earlier step means the run
was resumed from an older checkpoint, so everything logged from that step on is dropped first.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.metrics import keys


class MetricsError(ValueError):
    """Bad metrics input or an unusable metrics sink."""


@dataclass
class Point:
    step: int
    time: float
    value: float


@dataclass
class History:
    series: dict[str, list[Point]] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    last_time: float = 0.0
    latest: dict[str, float] = field(default_factory=dict)
    # Per-step staleness counts, (step, {k: n}); summed on demand so a rewind can drop steps.
    hist_rows: list[tuple[int, dict[int, float]]] = field(default_factory=list)
    hist_cumulative: dict[int, float] = field(default_factory=dict)

    def add(self, step: int, time: float, metrics: dict[str, float]) -> None:
        if self.steps and step < self.steps[-1]:
            self._rewind(step)
        if not self.steps or step != self.steps[-1]:
            self.steps.append(step)
        self.last_time = max(self.last_time, time)
        per_step: dict[int, float] = {}
        for key, value in metrics.items():
            self.latest[key] = value
            if key in keys.SERIES:
                self.series.setdefault(key, []).append(Point(step, time, value))
            elif (k := keys.hist_bin(key, keys.STALENESS_HIST)) is not None:
                per_step[k] = value
            elif (k := keys.hist_bin(key, keys.LAG_TAKEN)) is not None:
                self.hist_cumulative[k] = value
        if per_step:
            self.hist_rows.append((step, per_step))

    def _rewind(self, step: int) -> None:
        self.steps = [s for s in self.steps if s < step]
        for key, points in self.series.items():
            self.series[key] = [p for p in points if p.step < step]
        self.hist_rows = [(s, h) for s, h in self.hist_rows if s < step]

    def values(self, key: str) -> list[float]:
        """Finite values of a series, in step order."""
        return [p.value for p in self.series.get(key, []) if math.isfinite(p.value)]

    def points(self, key: str) -> list[Point]:
        return [p for p in self.series.get(key, []) if math.isfinite(p.value)]

    def staleness_hist(self) -> dict[int, int]:
        """Trained groups per staleness over the run: summed per-step counts when the run
        logged any, else the latest cumulative `replay/lag_taken/<k>` counts."""
        summed: Counter[int] = Counter()
        for _, hist in self.hist_rows:
            for k, n in hist.items():
                if math.isfinite(n):
                    summed[k] += int(n)
        source = summed if self.hist_rows else self.hist_cumulative
        return {k: int(n) for k, n in sorted(source.items()) if math.isfinite(n) and n > 0}

    def latest_finite(self, key: str) -> float | None:
        value = self.latest.get(key)
        return value if value is not None and math.isfinite(value) else None

    @classmethod
    def from_jsonl(cls, path: Path) -> History:
        """Read a `metrics.jsonl` back (null → NaN); a torn last line (crash) is skipped."""
        history = cls()
        if not path.exists():
            return history
        with path.open(encoding="utf-8") as f:
            lines = f.read().splitlines()
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step, time = int(row.pop("step")), float(row.pop("time"))
                row.pop("timestamp", None)
                metrics = {k: math.nan if v is None else float(v) for k, v in row.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                if lineno == len(lines):
                    break  # a write cut short by a crash; everything before it stands
                raise MetricsError(f"{path}:{lineno}: not a metrics row ({exc})") from None
            history.add(step, time, metrics)
        return history

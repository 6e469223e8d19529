"""Step rows held back while their step's evaluation runs, so that an evaluation done off the
training loop still lands in the row of the step whose weights it measured.

The loop hands every step's metrics to `DeferredRows.add`; a row whose step has an evaluation
in flight waits (and so does every later row: rows are written in step order, one per step),
while the learner goes on training. `land` merges finished evaluations into their rows and
`flush` writes every row no evaluation still holds. With the loop's pinning (an evaluation ends
before the next weight sync) a row waits about one step. A failed evaluation holds nothing:
its row is written without `eval/*`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Protocol


class StepLog(Protocol):
    def elapsed(self) -> float: ...

    def log(self, step: int, metrics: dict[str, float], *, at: float | None = None) -> None: ...


class DeferredRows:
    """Rows not yet written, oldest first: `(step, metrics)`, each with the time its step ended
    (written with it: a held row keeps its step's time, not the time it was written)."""

    def __init__(self, log: StepLog) -> None:
        self._log = log
        self.rows: list[tuple[int, dict[str, float]]] = []
        self._ended: dict[int, float] = {}

    def add(self, step: int, metrics: dict[str, float]) -> None:
        """The metrics of `step` (after every step already added)."""
        if self.rows and step <= self.rows[-1][0]:
            raise ValueError(f"deferred rows: step {step} after step {self.rows[-1][0]}")
        self.rows.append((step, metrics))
        self._ended[step] = self._log.elapsed()

    def land(self, results: Iterable[tuple[int, dict[str, float]]]) -> None:
        """Merge finished evaluations into the rows of their steps (a row already written
        cannot take one: ValueError, a bug in the caller's order)."""
        rows = dict(self.rows)
        for step, metrics in results:
            if step not in rows:
                raise ValueError(f"deferred rows: evaluation of step {step} has no pending row")
            rows[step].update(metrics)

    def flush(self, held: Collection[int]) -> None:
        """Write, in step order, every row up to the first one whose step is in `held` (its
        evaluation is still in flight)."""
        while self.rows and self.rows[0][0] not in held:
            step, metrics = self.rows.pop(0)
            self._log.log(step, metrics, at=self._ended.pop(step))

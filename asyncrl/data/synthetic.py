"""Synthetic verifiable task: multi-digit arithmetic, generated in process.

Rows are ``{"prompt": "12+345=", "answer": "357"}``. The split of every problem into train or
held-out is a pure function of the problem text and ``task.split_seed`` (a keyed hash), so the
two splits are disjoint whatever seeds or sizes are used to sample them: a held-out problem can
never appear in any train sample, and vice versa.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from asyncrl.data.datasets import DatasetError

Split = Literal["train", "heldout"]
_OPS = ("+", "-", "*")


@dataclass(frozen=True)
class ArithmeticTask:
    """The problem space. ``digits`` bounds the operands of ``+`` and ``-``; a product is an
    operand of up to ``digits`` digits times one of up to ``mul_digits`` digits."""

    ops: tuple[str, ...] = ("+", "-", "*")
    digits: int = 2
    mul_digits: int = 1
    heldout_fraction: float = 0.1
    split_seed: int = 0

    def __post_init__(self) -> None:
        bad = [op for op in self.ops if op not in _OPS]
        if not self.ops or bad:
            raise ValueError(
                f"ArithmeticTask.ops must be a non-empty subset of {_OPS}, got {self.ops}"
            )
        if self.digits < 1 or self.mul_digits < 1:
            raise ValueError("ArithmeticTask.digits and mul_digits must be >= 1")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError("ArithmeticTask.heldout_fraction must be in (0, 1)")

    def space_size(self) -> int:
        """Number of distinct problems (before the train/held-out split)."""
        n = 10**self.digits
        per_op = {"+": n * n, "-": n * (n + 1) // 2, "*": n * 10**self.mul_digits}
        return sum(per_op[op] for op in self.ops)


#: The task of the embedded default: the tiny model is warm-started on it
#: (`asyncrl.models.tiny.TinyModelSpec.task`) and `asyncrl run` trains on it.
EMBEDDED_TASK = ArithmeticTask()


def solve(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}")


def split_of(prompt: str, task: ArithmeticTask) -> Split:
    """The split a problem belongs to: a keyed hash of its text, independent of sampling seeds."""
    key = f"{task.split_seed}:{prompt}".encode()
    h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
    return "heldout" if h / 2**64 < task.heldout_fraction else "train"


def _sample_problem(rng: random.Random, task: ArithmeticTask) -> tuple[int, str, int]:
    op = rng.choice(task.ops)
    a = rng.randrange(10**task.digits)
    b = rng.randrange(10 ** (task.mul_digits if op == "*" else task.digits))
    if op == "-" and b > a:
        a, b = b, a  # answers stay non-negative
    return a, op, b


def make_rows(
    task: ArithmeticTask, split: Split, n: int, seed: int, unique: bool = True
) -> list[dict[str, str]]:
    """``n`` rows of ``split``, deterministic in ``(task, split, n, seed)``.

    With ``unique`` no problem repeats; a request larger than the split can supply is a
    `DatasetError` (the expected split size is ``space_size() * fraction``): a run asking for
    more held-out prompts (`logging.eval_size`) than the task has gets one line, not a trace.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"{seed}:{split}")
    fraction = task.heldout_fraction if split == "heldout" else 1.0 - task.heldout_fraction
    if unique and n > 0.9 * task.space_size() * fraction:
        raise DatasetError(
            f"asked for {n} unique {split} problems but the arithmetic task has only about "
            f"{int(task.space_size() * fraction)}; raise digits or lower n (logging.eval_size "
            "for the held-out split)"
        )
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    budget = 100 * n + 10_000  # the hash split is only approximately `fraction` on tiny spaces
    while len(rows) < n:
        budget -= 1
        if budget < 0:
            raise DatasetError(
                f"could not draw {n} unique {split} problems; raise digits or lower n"
            )
        a, op, b = _sample_problem(rng, task)
        prompt = f"{a}{op}{b}="
        if split_of(prompt, task) != split or (unique and prompt in seen):
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "answer": str(solve(a, op, b))})
    return rows


def to_messages(row: dict[str, str]) -> dict[str, object]:
    """The same row in chat form: ``{"messages": [{"role": "user", ...}], "answer": ...}``."""
    out: dict[str, object] = {k: v for k, v in row.items() if k != "prompt"}
    out["messages"] = [{"role": "user", "content": row["prompt"]}]
    return out


def write_jsonl(
    rows: Iterable[dict[str, str]],
    path: str | Path,
    form: Literal["prompt", "messages"] = "prompt",
) -> Path:
    """Write rows as JSONL for the prompt loader (``form`` picks the prompt or messages column)."""
    if form not in ("prompt", "messages"):
        raise ValueError(f"form must be 'prompt' or 'messages', got {form!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            obj = to_messages(row) if form == "messages" else row
            f.write(json.dumps(obj) + "\n")
    return path

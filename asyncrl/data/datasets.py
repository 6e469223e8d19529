"""Prompt datasets: JSON (a list of objects), JSONL, CSV and Parquet files; a prompt column or a
messages column (exactly one); prompts rendered natively (the tokenizer's chat template) or raw.

Every other column is kept as per-row metadata for the reward (e.g. ``answer``). Bad input is a
one-line ``DatasetError`` naming the file and row; prompts longer than ``prompt_length`` are
skipped and counted (or rejected with ``overlong="error"``), never dropped silently.
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

log = logging.getLogger(__name__)

Template = Literal["native", "none", "raw"]
FORMATS = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}
FORMATS |= {".parquet": "parquet", ".pq": "parquet"}


class DatasetError(ValueError):
    """Bad prompt data or data settings (file, column, row, template)."""


@dataclass(frozen=True)
class PromptRecord:
    """One validated row: exactly one of ``prompt`` / ``messages`` is set."""

    source: str  # file name, for messages
    where: str  # "row 3" or "line 3", for messages
    prompt: str | None
    messages: list[dict[str, Any]] | None
    metadata: dict[str, Any]


@dataclass(frozen=True)
class Prompt:
    """A prompt ready for the engine: token ids, the text they encode, the row's metadata."""

    input_ids: list[int]
    text: str
    metadata: dict[str, Any]
    index: int  # position of the record in the dataset (stable across epochs)
    key: str  # "e<epoch>-i<position in the epoch>": unique over a run, usable as a group id


# ---- reading files ----------------------------------------------------------------------------


def _read_json(path: Path) -> list[tuple[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(data, list):
        raise DatasetError(
            f"{path}: a .json dataset must be a list of objects (use .jsonl for lines)"
        )
    return [(f"row {i + 1}", obj) for i, obj in enumerate(data)]


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: line {lineno}: invalid JSON ({exc.msg})") from None
    return rows


def _read_csv(path: Path) -> list[tuple[str, Any]]:
    with path.open(encoding="utf-8", newline="") as f:
        return [(f"row {i + 1}", dict(obj)) for i, obj in enumerate(csv.DictReader(f))]


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DatasetError(f"{path}: cannot read Parquet ({exc})") from None
    return [(f"row {i + 1}", obj) for i, obj in enumerate(table.to_pylist())]


_READERS = {"json": _read_json, "jsonl": _read_jsonl, "csv": _read_csv, "parquet": _read_parquet}


def read_rows(path: str | Path) -> list[tuple[str, Any]]:
    """Raw rows of one file as ``(where, object)`` pairs; the format follows the extension."""
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DatasetError(
            f"{path}: unsupported extension {path.suffix!r}; supported: {', '.join(sorted(FORMATS))}"
        )
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    return _READERS[fmt](path)


# ---- validating rows --------------------------------------------------------------------------


def _choose_column(
    path: Path, columns: set[str], prompt: str | None, messages: str | None
) -> tuple[str, str]:
    """``(kind, column)``: the configured column, or the one of ``prompt``/``messages`` present."""
    if prompt and messages:
        raise DatasetError(
            f"{path}: set either prompt ({prompt!r}) or messages ({messages!r}) column, not both"
        )
    if prompt or messages:
        kind, column = ("prompt", prompt) if prompt else ("messages", messages)
        if column not in columns:
            have = ", ".join(sorted(columns)) or "none"
            raise DatasetError(f"{path}: {kind} column {column!r} not found (columns: {have})")
        return kind, column
    found = [name for name in ("prompt", "messages") if name in columns]
    if len(found) != 1:
        what = (
            "both 'prompt' and 'messages' columns" if found else "no 'prompt' or 'messages' column"
        )
        raise DatasetError(f"{path}: {what}; name the column with data_args.prompt or .messages")
    return found[0], found[0]


def _check_messages(value: Any, here: str) -> list[dict[str, Any]]:
    if isinstance(value, str):  # CSV (and some Parquet files) hold messages as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DatasetError(f"{here}: messages is a string but not JSON") from None
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{here}: messages must be a non-empty list, got {type(value).__name__}")
    for i, msg in enumerate(value):
        if not (isinstance(msg, dict) and isinstance(msg.get("role"), str)):
            raise DatasetError(f"{here}: message {i} must be an object with a string 'role'")
        if not isinstance(msg.get("content"), str):
            raise DatasetError(f"{here}: message {i} must have a string 'content'")
    return value


def _to_record(path: Path, where: str, obj: Any, kind: str, column: str) -> PromptRecord:
    here = f"{path}: {where}"
    if not isinstance(obj, dict):
        raise DatasetError(f"{here}: expected an object, got {type(obj).__name__}")
    if obj.get(column) is None or obj[column] == "":  # a CSV gap reads as ""
        raise DatasetError(f"{here}: missing {kind} column {column!r}")
    value = obj[column]
    metadata = {k: v for k, v in obj.items() if k != column}
    if kind == "messages":
        return PromptRecord(str(path), where, None, _check_messages(value, here), metadata)
    if not isinstance(value, str):
        raise DatasetError(
            f"{here}: prompt column {column!r} must be a string, got {type(value).__name__}"
        )
    return PromptRecord(str(path), where, value, None, metadata)


def load_records(
    paths: str | Path | Sequence[str | Path], prompt: str | None = None, messages: str | None = None
) -> list[PromptRecord]:
    """Validated records of one or more files. ``prompt``/``messages`` name the column to use
    (at most one; with neither, a column literally named ``prompt`` or ``messages`` is used)."""
    paths = [paths] if isinstance(paths, str | Path) else list(paths)
    if not paths:
        raise DatasetError("no prompt data files given")
    records: list[PromptRecord] = []
    for path in map(Path, paths):
        rows = read_rows(path)
        if not rows:
            raise DatasetError(f"{path}: no rows")
        columns = set().union(*(obj.keys() for _, obj in rows if isinstance(obj, dict)))
        kind, column = _choose_column(path, columns, prompt, messages)
        records.extend(_to_record(path, where, obj, kind, column) for where, obj in rows)
    return records


# ---- rendering and tokenising -----------------------------------------------------------------


def _template(name: str) -> str:
    if name not in ("native", "none", "raw"):
        raise DatasetError(f"template must be 'native' or 'none' (alias 'raw'), got {name!r}")
    return "none" if name == "raw" else name


def render(record: PromptRecord, tokenizer: Any, template: str) -> tuple[str, bool]:
    """``(text, templated)``: the prompt text the model sees, and whether a chat template made it."""
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if record.messages is not None and not (template == "native" and has_chat):
        raise DatasetError(
            f"{record.source}: {record.where}: messages need template 'native' and a tokenizer "
            "with a chat template"
        )
    if record.prompt is not None and (template == "none" or not has_chat):
        return record.prompt, False
    messages = record.messages or [{"role": "user", "content": record.prompt}]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # template errors come as jinja2 / ValueError types
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DatasetError(
            f"{record.source}: {record.where}: chat template failed ({first_line})"
        ) from None
    return text, True


def encode(record: PromptRecord, tokenizer: Any, template: str = "native") -> tuple[str, list[int]]:
    """Rendered text and its token ids (a chat template carries its own special tokens)."""
    text, templated = render(record, tokenizer, _template(template))
    ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
    return text, list(ids)


# ---- the resumable stream ---------------------------------------------------------------------


class PromptStream:
    """Endless prompts, epoch after epoch, in a deterministic per-epoch order.

    The position (epoch, index into that epoch's order) and counters round-trip through
    ``state_dict``/``load_state_dict``, so a resumed run continues with the very next prompt.
    Not thread-safe: one consumer, or the caller serialises ``next_prompt``.
    """

    def __init__(
        self,
        records: Sequence[PromptRecord],
        tokenizer: Any,
        *,
        template: str = "native",
        prompt_length: int | None = None,
        overlong: Literal["skip", "error"] = "skip",
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if not records:
            raise DatasetError("prompt stream has no records")
        if overlong not in ("skip", "error"):
            raise DatasetError(f"overlong must be 'skip' or 'error', got {overlong!r}")
        self.records, self.tokenizer = list(records), tokenizer
        self.template, self.prompt_length, self.overlong = (
            _template(template),
            prompt_length,
            overlong,
        )
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.index, self.skipped_overlong = 0, 0, 0
        self._order_epoch, self._order = -1, np.arange(0)

    def __len__(self) -> int:
        return len(self.records)

    def _order_for(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            n = len(self.records)
            rng = np.random.default_rng([self.seed, epoch])
            self._order = rng.permutation(n) if self.shuffle else np.arange(n)
            self._order_epoch = epoch
        return self._order

    def next_prompt(self) -> Prompt:
        """The next prompt that fits ``prompt_length``; overlong ones are skipped and counted."""
        for _ in range(len(self.records)):
            if self.index >= len(self.records):
                self.epoch, self.index = self.epoch + 1, 0
            position = int(self._order_for(self.epoch)[self.index])
            key = f"e{self.epoch}-i{self.index}"
            self.index += 1
            record = self.records[position]
            text, ids = encode(record, self.tokenizer, self.template)
            if self.prompt_length is None or len(ids) <= self.prompt_length:
                return Prompt(ids, text, dict(record.metadata), position, key)
            self._overlong(record, len(ids))
        raise DatasetError(
            f"{self.records[0].source}: every prompt is longer than prompt_length={self.prompt_length}"
        )

    def _overlong(self, record: PromptRecord, n_tokens: int) -> None:
        here = f"{record.source}: {record.where}"
        if self.overlong == "error":
            raise DatasetError(
                f"{here}: prompt has {n_tokens} tokens > prompt_length={self.prompt_length}"
            )
        if self.skipped_overlong == 0:
            log.warning(
                "%s: skipping prompt of %d tokens > prompt_length=%d (counted in "
                "data/skipped_overlong)",
                here,
                n_tokens,
                self.prompt_length,
            )
        self.skipped_overlong += 1

    def stats(self) -> dict[str, int]:
        """Counters for the metrics stream."""
        return {"data/epoch": self.epoch, "data/skipped_overlong": self.skipped_overlong}

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "num_records": len(self.records),
            "skipped_overlong": self.skipped_overlong,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["num_records"]) != len(self.records):
            raise DatasetError(
                f"prompt stream state is for {state['num_records']} records but the data has "
                f"{len(self.records)}; the dataset changed since the checkpoint"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.seed, self.skipped_overlong = int(state["seed"]), int(state["skipped_overlong"])
        self._order_epoch = -1  # the order depends on the restored seed


def open_prompt_stream(
    paths: str | Path | Sequence[str | Path],
    tokenizer: Any,
    *,
    prompt: str | None = None,
    messages: str | None = None,
    template: str = "native",
    prompt_length: int | None = None,
    overlong: Literal["skip", "error"] = "skip",
    shuffle: bool = True,
    seed: int = 0,
) -> PromptStream:
    """Load ``paths`` and wrap them in a :class:`PromptStream`."""
    records = load_records(paths, prompt=prompt, messages=messages)
    return PromptStream(
        records,
        tokenizer,
        template=template,
        prompt_length=prompt_length,
        overlong=overlong,
        shuffle=shuffle,
        seed=seed,
    )


def load_rows(
    path: str | Path, prompt: str | None = None, messages: str | None = None
) -> list[dict[str, Any]]:
    """Validated rows as plain dicts under normalised keys: ``"prompt"`` (a string) or
    ``"messages"`` (a list), whichever column was chosen, plus every metadata column."""
    rows = []
    for rec in load_records(path, prompt=prompt, messages=messages):
        key, value = (
            ("prompt", rec.prompt) if rec.prompt is not None else ("messages", rec.messages)
        )
        rows.append({**rec.metadata, key: value})
    return rows

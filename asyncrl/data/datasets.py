"""Prompt datasets: JSON (a list of objects), JSONL, CSV and Parquet files; a prompt column or a
messages column (exactly one); prompts rendered natively (the tokenizer's chat template) or raw.

Every other column is kept as per-row metadata for the reward (e.g. ``answer``). Bad input is a
one-line ``DatasetError`` naming the file and row. The epoch order, the resumable position and
the skipping of overlong prompts live in `asyncrl.data.prompts.PromptSource`.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}
FORMATS |= {".parquet": "parquet", ".pq": "parquet"}


class DatasetError(ValueError):
    """Bad prompt data or data settings (file, column, row, template)."""


@dataclass(frozen=True)
class PromptRecord:
    """One validated row: exactly one of ``prompt`` / ``messages`` is set (neither for an env
    seed row, whose prompt the episode builder makes)."""

    source: str  # file name, for messages
    where: str  # "row 3" or "line 3", for messages
    prompt: str | None
    messages: list[dict[str, Any]] | None
    metadata: dict[str, Any]


# ---- reading files ----------------------------------------------------------------------------


def _not_utf8(path: Path, line: int, data: bytes, at: int) -> DatasetError:
    return DatasetError(f"{path}: line {line}: not UTF-8 text (byte 0x{data[at]:02x})")


def _read_text(path: Path) -> str:
    """The whole file as UTF-8 text (a leading byte-order mark dropped); a bad byte is one line
    naming its line number."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read ({exc.strerror})") from None
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, data.count(b"\n", 0, exc.start) + 1, data, exc.start) from None


def _read_json(path: Path) -> list[tuple[str, Any]]:
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(data, list):
        raise DatasetError(
            f"{path}: a .json dataset must be a list of objects (use .jsonl for lines)"
        )
    return [(f"row {i + 1}", obj) for i, obj in enumerate(data)]


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    """Line by line, in bytes: a file larger than memory twice over still loads, and a bad byte
    or bad JSON names its line."""
    rows = []
    try:
        f = path.open("rb")
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read ({exc.strerror})") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            raw = raw.removeprefix(codecs.BOM_UTF8) if lineno == 1 else raw
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _not_utf8(path, lineno, raw, exc.start) from None
            if not line.strip():
                continue
            try:
                rows.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: line {lineno}: invalid JSON ({exc.msg})") from None
    return rows


def _read_csv(path: Path) -> list[tuple[str, Any]]:
    reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
    try:
        return [(f"row {i + 1}", dict(obj)) for i, obj in enumerate(reader)]
    except csv.Error as exc:  # a NUL byte, an unterminated quote, an oversized field
        line = reader.reader.line_num  # the DictReader's own count lags by the failed row
        raise DatasetError(f"{path}: line {line}: invalid CSV ({exc})") from None


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DatasetError(f"{path}: cannot read Parquet ({exc})") from None
    return [(f"row {i + 1}", obj) for i, obj in enumerate(table.to_pylist())]


_READERS = {"json": _read_json, "jsonl": _read_jsonl, "csv": _read_csv, "parquet": _read_parquet}


def check_file(path: str | Path) -> Path:
    """`path` is a readable file of a supported format (its rows are read later)."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise DatasetError(
            f"{path}: unsupported extension {path.suffix!r}; supported: {', '.join(sorted(FORMATS))}"
        )
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    if not os.access(path, os.R_OK):
        raise DatasetError(f"{path}: not readable (permission denied)")
    return path


def read_rows(path: str | Path) -> list[tuple[str, Any]]:
    """Raw rows of one file as ``(where, object)`` pairs; the format follows the extension."""
    path = check_file(path)
    return _READERS[FORMATS[path.suffix.lower()]](path)


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


def render(record: PromptRecord, tokenizer: Any, template: str) -> str:
    """The prompt text the model sees: the raw prompt (``none``, or a tokenizer without a chat
    template) or the tokenizer's chat template with the generation prompt (``native``)."""
    template = _template(template)
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if record.messages is not None and not (template == "native" and has_chat):
        raise DatasetError(
            f"{record.source}: {record.where}: messages need template 'native' and a tokenizer "
            "with a chat template"
        )
    if record.prompt is not None and (template == "none" or not has_chat):
        return record.prompt
    messages = record.messages or [{"role": "user", "content": record.prompt}]
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # template errors come as jinja2 / ValueError types
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DatasetError(
            f"{record.source}: {record.where}: chat template failed ({first_line})"
        ) from None


def encode(record: PromptRecord, tokenizer: Any, template: str = "native") -> tuple[str, list[int]]:
    """Rendered text and its token ids, tokenized as is: no special tokens are added (a chat
    template writes its own; raw prompts get none, as the embedded task was trained)."""
    text = render(record, tokenizer, template)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])

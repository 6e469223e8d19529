"""Prompts for the rollout workers: the configured dataset (or the embedded task) as PromptItems.

Keys are `e<epoch>-i<index>`, unique over the run, and become group ids, so a prompt re-issued
after a failure can never be trained on twice (the replay queue rejects the duplicate id).
The position (epoch, index) is part of every checkpoint. Reading, validating and rendering the
prompts is `asyncrl.data.datasets`; this module orders, positions and filters them.
"""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.data import datasets
from asyncrl.data.datasets import DatasetError, PromptRecord

log = logging.getLogger(__name__)

EMBEDDED_TRAIN_ROWS = 8000


@dataclass
class PromptItem:
    """One prompt handed to a rollout worker; `key` is unique over the run and becomes the group
    id. `metadata` is the prompt row's other fields, as the reward function sees them (the
    group carries them under `metadata["data"]`). Env runs carry `metadata["env_seed"]` and no
    ids (the episode builder templates them). `engine_version`: the weight version every
    engine held when the prompt was handed out (None: not known), so its requests use that
    version's prefix-cache namespace even before an engine's reply shows it."""

    key: str
    prompt_ids: list[int]
    prompt_text: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    engine_version: int | None = None


def _records(source: str, rows: list[dict[str, Any]]) -> list[PromptRecord]:
    """In-memory rows (the embedded task, env seeds): `prompt` when present, the rest metadata."""
    records = []
    for i, row in enumerate(rows):
        meta = {k: v for k, v in row.items() if k != "prompt"}
        records.append(PromptRecord(source, f"row {i + 1}", row.get("prompt"), None, meta))
    return records


def load_prompt_records(cfg: Config) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """`(train, held-out)` records of a run: env seeds, the data files, or the embedded task."""
    data = cfg.actor_train.data_args
    if cfg.env is not None:  # env runs: the prompts are env seeds, no held-out split
        from asyncrl.data.env_prompts import seed_rows

        return _records("env", seed_rows(cfg.env)), []
    if data.file_name:
        heldout = data.eval_file_name
        return (
            datasets.load_records(data.file_name, data.prompt, data.messages),
            datasets.load_records(heldout, data.prompt, data.messages) if heldout else [],
        )
    from asyncrl.data.synthetic import EMBEDDED_TASK, make_rows

    task = EMBEDDED_TASK
    train = make_rows(task, "train", EMBEDDED_TRAIN_ROWS, seed=cfg.seed)
    heldout = make_rows(task, "heldout", cfg.logging.eval_size, seed=cfg.seed)
    return _records("embedded", train), _records("embedded", heldout)


class PromptSource:
    """Training prompts, epoch after epoch in a per-epoch order (shuffled from the run seed), from
    a position that round-trips through `state_dict`; and the held-out prompts. Thread-safe."""

    def __init__(self, cfg: Config, model_dir: Path) -> None:
        from asyncrl.data.tokenizer import model_tokenizer

        self.tokenizer = model_tokenizer(model_dir)
        self.data_args = cfg.actor_train.data_args
        self.prompt_length = cfg.prompt_length
        self.seed = cfg.seed
        # Whether rows are env seeds is the run's mode, never a column's name: a dataset with
        # an `env_seed` column is still a dataset of prompts.
        self.env_run = cfg.env is not None
        self.train_records, self.heldout_records = load_prompt_records(cfg)
        if not self.train_records:
            raise DatasetError("the training prompt set is empty")
        self.epoch, self.index = 0, 0
        self.skipped = 0
        self._order = self._epoch_order(0)
        self._lock = threading.Lock()

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.train_records)))
        if self.data_args.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _item(self, key: str, record: PromptRecord) -> PromptItem | None:
        """The record as an item; None when its prompt is empty or over `prompt_length`."""
        meta = dict(record.metadata)
        if self.env_run:  # the episode builder resets the env and templates the prompt
            return PromptItem(key=key, prompt_ids=[], metadata=meta)
        text, ids = datasets.encode(record, self.tokenizer, self.data_args.template)
        if not ids or len(ids) > self.prompt_length:
            return None
        return PromptItem(key=key, prompt_ids=ids, prompt_text=text, metadata=meta)

    def render(self, row: dict[str, Any]) -> str:
        """Prompt text as the model sees it, for a row with a `prompt` or `messages` key."""
        record = PromptRecord("row", "row", row.get("prompt"), row.get("messages"), {})
        return datasets.render(record, self.tokenizer, self.data_args.template)

    def next_item(self) -> PromptItem:
        """The next prompt in (shuffled) epoch order; prompts over `prompt_length` are skipped
        and counted in `skipped`."""
        with self._lock:
            for _ in range(len(self.train_records) + 1):
                if self.index >= len(self._order):
                    self.epoch, self.index = self.epoch + 1, 0
                    self._order = self._epoch_order(self.epoch)
                key = f"e{self.epoch}-i{self.index}"
                record = self.train_records[self._order[self.index]]
                self.index += 1
                item = self._item(key, record)
                if item is not None:
                    return item
                if self.skipped == 0:  # once: the rest are only counted
                    where, limit = f"{record.source}: {record.where}", self.prompt_length
                    log.warning("%s: prompt over prompt_length=%d, skipped", where, limit)
                self.skipped += 1
        raise DatasetError(f"no training prompt fits prompt_length={self.prompt_length}")

    def heldout_items(self, n: int) -> list[PromptItem]:
        """The first `n` held-out prompts (keys `heldout-<i>`), less those over `prompt_length`."""
        items = (self._item(f"heldout-{i}", r) for i, r in enumerate(self.heldout_records[:n]))
        return [it for it in items if it is not None]

    def state_dict(self) -> dict[str, Any]:
        """The data position, for the checkpoint."""
        with self._lock:
            return {"epoch": self.epoch, "index": self.index, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a checkpointed position: the next item is the one that would have come."""
        with self._lock:
            self.epoch, self.index = int(state["epoch"]), int(state["index"])
            self.skipped = int(state.get("skipped", 0))
            self._order = self._epoch_order(self.epoch)

"""Prompts for the rollout actors: the configured dataset (or the embedded task) as PromptItems.

Keys are `e<epoch>-i<index>`, unique over the run, and become group ids, so a prompt re-issued
after a failure can never be trained on twice (the replay queue rejects the duplicate id).
The position (epoch, index) is part of every checkpoint.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.rollout.actor import PromptItem

EMBEDDED_TRAIN_ROWS = 8000


class PromptSource:
    def __init__(self, cfg: Config, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.data_args = cfg.actor_train.data_args
        self.prompt_length = cfg.prompt_length
        self.seed = cfg.seed
        self.train_rows, self.heldout_rows = self._load_rows(cfg)
        if not self.train_rows:
            raise ValueError("the training prompt set is empty")
        self.epoch, self.index = 0, 0
        self.skipped = 0
        self._order = self._epoch_order(0)
        self._lock = threading.Lock()

    def _load_rows(self, cfg: Config) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        data = cfg.actor_train.data_args
        if cfg.env is not None:  # env runs: the prompts are env seeds, no held-out split
            from asyncrl.rollout.env_prompts import seed_rows

            return seed_rows(cfg.env), []
        if not data.file_name:
            from asyncrl.data.synthetic import make_rows
            from asyncrl.models.tiny import DEFAULT_SPEC

            task = DEFAULT_SPEC.task
            train = make_rows(task, "train", EMBEDDED_TRAIN_ROWS, seed=cfg.seed)
            heldout = make_rows(task, "heldout", cfg.logging.eval_size, seed=cfg.seed)
            return train, heldout
        from asyncrl.data.datasets import load_rows

        train = [r for f in data.file_name for r in load_rows(f, data.prompt, data.messages)]
        heldout = [r for f in data.eval_file_name for r in load_rows(f, data.prompt, data.messages)]
        return train, heldout

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.train_rows)))
        if self.data_args.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _item(self, key: str, row: dict[str, Any]) -> PromptItem | None:
        if "env_seed" in row:  # the episode builder resets the env and templates the prompt
            return PromptItem(key=key, prompt_ids=[], metadata=dict(row))
        text = self.render(row)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids or len(ids) > self.prompt_length:
            return None
        meta = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
        return PromptItem(key=key, prompt_ids=list(ids), prompt_text=text, metadata=meta)

    def render(self, row: dict[str, Any]) -> str:
        """Prompt text as the model sees it: raw, or through the tokenizer's chat template."""
        messages = row.get("messages")
        if self.data_args.template == "native":
            messages = messages or [{"role": "user", "content": row["prompt"]}]
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        if messages is not None:
            return "\n".join(m["content"] for m in messages)
        return row["prompt"]

    def next_item(self) -> PromptItem:
        """The next prompt in (shuffled) epoch order; prompts over `prompt_length` are skipped
        and counted in `skipped`."""
        with self._lock:
            for _ in range(len(self.train_rows) + 1):
                if self.index >= len(self._order):
                    self.epoch, self.index = self.epoch + 1, 0
                    self._order = self._epoch_order(self.epoch)
                row_index = self._order[self.index]
                key = f"e{self.epoch}-i{self.index}"
                self.index += 1
                item = self._item(key, self.train_rows[row_index])
                if item is not None:
                    return item
                self.skipped += 1
        raise ValueError(f"no training prompt fits prompt_length={self.prompt_length}")

    def heldout_items(self, n: int) -> list[PromptItem]:
        items = (self._item(f"heldout-{i}", r) for i, r in enumerate(self.heldout_rows[:n]))
        return [it for it in items if it is not None]

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"epoch": self.epoch, "index": self.index, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.epoch, self.index = int(state["epoch"]), int(state["index"])
            self.skipped = int(state.get("skipped", 0))
            self._order = self._epoch_order(self.epoch)

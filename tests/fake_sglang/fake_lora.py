"""The fake SGLang's native LoRA: `--enable-lora`, adapter load/unload, `lora_path` on /generate.

Modelled on SGLang 0.5.6-0.5.23 (`tokenizer_manager`, `lora/lora_registry.py`,
`lora/lora_manager.py`):
- without `--enable-lora` a load, an unload or a request naming an adapter is refused;
- a load reads the PEFT directory (`adapter_config.json` + `adapter_model.safetensors`); a rank
  above `--max-lora-rank` or a target module outside `--lora-target-modules` (unless `all`) is
  refused, as SGLang's memory pool refuses it; a name loaded twice is refused;
- an unload stops new requests naming the adapter at once and answers only when the requests
  running on it have finished (SGLang's `unregister` then `wait_for_unload`);
- a request naming an adapter never loaded is refused (HTTP 400 `{"error": {"message"}}`);
  one unloaded since is reloaded from its path (SGLang's `lora_ref_cache`), refused if the
  directory is gone;
- `FAKE_SGLANG_LORA_REFUSE` (names, comma-separated): loads of these fail, as SGLang's do when
  e.g. its memory pool cannot take the adapter (a test's way to make one sync fail);
- the adapter is applied: a request's logprobs are the base's (-0.5) shifted by a number drawn
  from the sha256 of the adapter's weights file (`adapter_logprob`), so a test can tell which
  file's weights served it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

#: SGLang 0.5.6's SUPPORTED_LORA_TARGET_MODULES (0.5.23 takes these and more), and "all".
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "qkv_proj", "gate_up_proj", "all"]  # fmt: skip
BASE_LOGPROB = -0.5


class LoraRefused(ValueError):
    """SGLang's ValueError for a LoRA request: the message is what the client sees."""


def adapter_logprob(weights_file: Path) -> float:
    """The per-token logprob of a request served with the adapter whose weights are this file."""
    digest = hashlib.sha256(Path(weights_file).read_bytes()).hexdigest()
    return BASE_LOGPROB - (1 + int(digest[:6], 16) % 1000) / 1000


def add_flags(parser) -> None:
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int)
    parser.add_argument("--lora-target-modules", type=str, nargs="*", choices=TARGETS)
    parser.add_argument("--max-loras-per-batch", type=int, default=8)
    parser.add_argument("--max-loaded-loras", type=int)


class FakeLora:
    def __init__(self, args) -> None:
        self.enabled = bool(args.enable_lora)
        self.max_rank = args.max_lora_rank
        self.targets = set(args.lora_target_modules or [])
        self.loaded: dict[str, tuple[str, float]] = {}  # name -> (path, logprob)
        self.ever: dict[str, str] = {}  # every name loaded once -> its path (lora_ref_cache)
        self.running: dict[str, int] = {}  # name -> requests running on it
        self.refuse = set(filter(None, os.environ.get("FAKE_SGLANG_LORA_REFUSE", "").split(",")))

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise LoraRefused("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")

    def load(self, name: str, path: str) -> None:
        self._check_enabled()
        if name in self.loaded:
            raise LoraRefused(f"LoRA adapter {name} is already loaded")
        if name in self.refuse:
            raise LoraRefused(f"Failed to load LoRA adapter {name}: no free LoRA memory slot")
        try:
            config = json.loads((Path(path) / "adapter_config.json").read_text())
            logprob = adapter_logprob(Path(path) / "adapter_model.safetensors")
        except (OSError, ValueError) as e:
            raise LoraRefused(f"Failed to load LoRA adapter {name} from {path}: {e}") from None
        modules = set(config.get("target_modules") or [])
        if (self.max_rank is not None and config.get("r", 0) > self.max_rank) or (
            "all" not in self.targets and not modules <= self.targets
        ):
            raise LoraRefused(
                f"LoRA adapter {name} with rank {config.get('r')} is incompatible with the current "
                "LoRA memory pool configuration. Please ensure that the LoRA adapter's rank is "
                "within the configured `--max-lora-rank` and that the target modules are included "
                "in `--lora-target-modules`."
            )
        self.loaded[name] = (path, logprob)
        self.ever[name] = path

    async def unload(self, name: str) -> None:
        self._check_enabled()
        if name not in self.loaded:
            raise LoraRefused(f"LoRA adapter {name} is not loaded")
        del self.loaded[name]  # no new request may start on it
        while self.running.get(name):  # the running ones finish on it
            await asyncio.sleep(0.01)

    def acquire(self, name: str | None) -> float:
        """A request starts on adapter `name` (None: the base); its per-token logprob."""
        if name is None:
            return BASE_LOGPROB
        self._check_enabled()
        if name not in self.loaded:
            if name not in self.ever:
                raise LoraRefused(f"Got LoRA adapter that has never been loaded: {name}")
            try:
                self.load(name, self.ever[name])
            except LoraRefused as e:
                raise LoraRefused(f"Failed to implicitly load LoRA adapter {name}: {e}") from None
        self.running[name] = self.running.get(name, 0) + 1
        return self.loaded[name][1]

    def release(self, name: str | None) -> None:
        if name is not None:
            self.running[name] -= 1

    def models(self, base: str) -> dict:
        """SGLang's `/v1/models`: the base model, then each loaded adapter with its parent."""
        cards = [{"id": base, "object": "model", "root": base, "parent": None}]
        cards += [{"id": n, "object": "model", "root": p, "parent": base}
                  for n, (p, _) in self.loaded.items()]  # fmt: skip
        return {"object": "list", "data": cards}

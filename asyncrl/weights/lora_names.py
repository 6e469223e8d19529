"""Names of the LoRA adapters asyncrl loads into SGLang (`weight_sync.lora_sync: native`).

Kept apart from `lora_native.py` (torch, peft) so the engine client, which names the adapter
on every request, imports nothing heavy."""

from __future__ import annotations

import re

#: Adapters asyncrl loads are named PREFIX + version; any other name on an engine is left alone.
PREFIX = "asyncrl-v"
_NAME = re.compile(r"^asyncrl-v(\d+)$")


def adapter_name(version: int) -> str:
    """The name the adapter of learner `version` is loaded under on every engine."""
    return f"{PREFIX}{version}"


def adapter_version(name: object) -> int | None:
    """The version an adapter name of asyncrl's stands for; None for any other name."""
    match = _NAME.match(name) if isinstance(name, str) else None
    return int(match.group(1)) if match else None

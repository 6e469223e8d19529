"""The reward-function contract and its error type."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


class RewardError(ValueError):
    """A reward could not be computed or resolved (bad name, missing metadata, missing package)."""


@runtime_checkable
class RewardFn(Protocol):
    """Score one response. ``metadata`` holds the prompt row's extra columns (e.g. ``answer``)."""

    def __call__(self, prompt: str, response: str, metadata: Mapping[str, Any]) -> float: ...

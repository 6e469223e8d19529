"""Rewards for the end-to-end tests: graded, so a random tiny model still gets a learning signal
(a test-only module, imported by dotted path, never shipped as a built-in)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def digit_fraction(prompt: str, response: str, metadata: Mapping[str, Any]) -> float:
    """Fraction of response characters that are digits."""
    return sum(c.isdigit() for c in response) / max(1, len(response))

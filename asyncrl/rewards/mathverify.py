"""Reward backed by the `math-verify` package (imported lazily; optional dependency)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from asyncrl.rewards.base import RewardError, RewardFn

PACKAGE_HINT = "reward 'math_verify' needs the `math-verify` package: pip install math-verify"


def make_math_verify() -> RewardFn:
    """Build the reward; fails now, with one line naming the package, when it is missing."""
    try:
        mv = importlib.import_module("math_verify")
    except ImportError:
        raise RewardError(PACKAGE_HINT) from None

    def math_verify(prompt: str, response: str, metadata: Mapping[str, Any]) -> float:
        if "answer" not in metadata:
            raise RewardError("math_verify needs an 'answer' metadata column in the prompt data")
        answer = str(metadata["answer"])
        # A bare gold answer is parsed as LaTeX math; an already delimited one as is.
        gold = mv.parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
        pred = mv.parse(response)
        return 1.0 if gold and pred and mv.verify(gold, pred) else 0.0

    return math_verify

"""Reward backed by the `math-verify` package (imported lazily; optional dependency)."""

from __future__ import annotations

import importlib
import threading
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
        # math-verify's own timeouts are signal.alarm, which works on the main thread only; a
        # rollout worker scores on its event-loop thread, where they must be off (math-verify
        # refuses them there). Its response is bounded by response_length tokens.
        limit = 5 if threading.current_thread() is threading.main_thread() else None
        # A bare gold answer is parsed as LaTeX math; an already delimited one as is.
        gold = mv.parse(
            answer if "$" in answer or "\\boxed" in answer else f"${answer}$",
            parsing_timeout=limit,
        )
        pred = mv.parse(response, parsing_timeout=limit)
        return 1.0 if gold and pred and mv.verify(gold, pred, timeout_seconds=limit) else 0.0

    return math_verify

"""Exact-match reward for the synthetic arithmetic task (and any integer-answer task)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from asyncrl.rewards.base import RewardError

# Text after the first of these is not part of the answer (EOS / chat end markers).
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")
_NUMBER = re.compile(r"-?\d+")


def parse_first_integer(response: str) -> int | None:
    """The first integer in ``response`` before any end marker, or None."""
    for marker in END_MARKERS:
        response = response.split(marker, 1)[0]
    match = _NUMBER.search(response)
    return int(match.group()) if match else None


def arithmetic_exact(prompt: str, response: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the first integer of the response equals ``metadata["answer"]``, else 0.0."""
    if "answer" not in metadata:
        raise RewardError("arithmetic_exact needs an 'answer' metadata column in the prompt data")
    try:
        gold = int(str(metadata["answer"]).strip())
    except ValueError:
        raise RewardError(
            f"arithmetic_exact: answer {metadata['answer']!r} is not an integer"
        ) from None
    return 1.0 if parse_first_integer(response) == gold else 0.0


def arithmetic_partial(prompt: str, response: str, metadata: Mapping[str, Any]) -> float:
    """``arithmetic_exact``, with partial credit below it: a wrong integer earns half the share
    of its digits that match the answer's, aligned from the units digit (sign included, the
    longer of the two counting). Near misses then rank above garbage, so far more groups carry
    a learning signal; only an exact answer reaches 1.0, which is what accuracy counts."""
    if arithmetic_exact(prompt, response, metadata) == 1.0:
        return 1.0
    got = parse_first_integer(response)
    if got is None:
        return 0.0
    gold, pred = str(int(str(metadata["answer"]).strip())), str(got)
    width = max(len(gold), len(pred))
    same = sum(a == b for a, b in zip(gold.rjust(width), pred.rjust(width)))
    return 0.5 * same / width


def format_integer(prompt: str, response: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the response, up to its end marker, is exactly one integer (a format reward)."""
    for marker in END_MARKERS:
        response = response.split(marker, 1)[0]
    return 1.0 if _NUMBER.fullmatch(response.strip()) else 0.0

"""Group filters: plain functions `(group) -> bool` that return True to *keep* a group.

The replay queue applies them in order when a group is put; the first filter that returns False
drops the group and is charged for it under its name (`filter_name`). A dropped group frees its
admission slot, so a rollout worker can start a replacement prompt (see `admission.py`).

Filters act on whole groups because group-normalised advantages (GRPO, DAPO) need every response
of a prompt; masking single over-long responses out of the loss is the loss's job (`algo/`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from asyncrl.types import TrajectoryGroup

GroupFilter = Callable[[TrajectoryGroup], bool]

#: `finish_reason` SGLang reports when a response hit `max_new_tokens`.
TRUNCATED = "length"


def dapo_zero_variance(group: TrajectoryGroup) -> bool:
    """DAPO dynamic sampling: keep a group only if its rewards are not all identical.

    A group whose rewards are all equal (all solved or all failed) has zero group-normalised
    advantage for every token, so it adds no gradient and only dilutes the batch. Groups of fewer
    than two responses have zero variance by definition and are dropped as well. Rewards are
    compared exactly (DAPO keeps a group iff std > 0).
    """
    rewards = group.rewards
    return len(rewards) >= 2 and bool(np.ptp(rewards) > 0)


def length_filter(
    max_response_length: int | None = None, *, drop_all_truncated: bool = True
) -> GroupFilter:
    """Build a filter named ``length`` that drops a group when

    - any of its responses is longer than `max_response_length` tokens (None: no limit), or
    - `drop_all_truncated` and every response ended with finish reason ``"length"`` (nothing in
      the group reached an answer, so its rewards say nothing about the policy).

    A group with only some truncated responses is kept: their loss can be masked downstream.
    """
    if max_response_length is not None and max_response_length < 0:
        raise ValueError(
            f"length filter: max_response_length must be >= 0, got {max_response_length}"
        )

    def length(group: TrajectoryGroup) -> bool:
        too_long = max_response_length is not None and group.n > 0
        if too_long and int(group.response_lengths.max()) > max_response_length:
            return False
        reasons = group.finish_reasons
        return not (drop_all_truncated and reasons and all(r == TRUNCATED for r in reasons))

    return length


def filter_name(fn: GroupFilter) -> str:
    """The name a filter's drops are counted under: its `__name__`, else its type's name."""
    return getattr(fn, "__name__", type(fn).__name__)


#: Config names of the built-in filters -> factory taking the spec's keyword arguments.
FILTER_FACTORIES: Mapping[str, Callable[..., GroupFilter]] = {
    "dapo_zero_variance": lambda: dapo_zero_variance,
    "length": length_filter,
}


def build_filters(specs: Sequence[str | Mapping[str, Any]]) -> list[GroupFilter]:
    """Filters from config specs: a name (``"dapo_zero_variance"``) or a mapping
    ``{"name": "length", "max_response_length": 4096}``. Unknown names raise ValueError."""
    out: list[GroupFilter] = []
    for spec in specs:
        kwargs = dict(spec) if isinstance(spec, Mapping) else {"name": spec}
        name = kwargs.pop("name", None)
        if name not in FILTER_FACTORIES:
            known = ", ".join(sorted(FILTER_FACTORIES))
            raise ValueError(f"unknown replay filter {name!r} (known: {known})")
        try:
            out.append(FILTER_FACTORIES[name](**kwargs))
        except TypeError as exc:
            raise ValueError(f"replay filter {name!r}: bad arguments {kwargs}: {exc}") from None
    return out

"""DAPO's soft overlong punishment (Yu et al., 2025, section 3.4): a response that runs into
the last `buffer_len` tokens of the generation budget loses reward linearly, up to
`penalty_factor` at `max_len`. The rollout worker adds it to each response's reward
(`algorithm.overlong_buffer_len`, `overlong_penalty_factor`).

DAPO's other group rule, dynamic sampling (drop a group whose rewards are all equal), is the
replay queue's filter `replay/filters.py:dapo_zero_variance`
(`algorithm.filter_zero_variance_groups`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def overlong_penalty(
    response_lengths: torch.Tensor | Sequence[int],
    max_len: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward.

    0 for ``len <= max_len - buffer_len``, then linear down to ``-penalty_factor`` at ``max_len``
    (and held there beyond it). Returns float32 [B].
    """
    if buffer_len <= 0 or buffer_len > max_len:
        raise ValueError(
            f"overlong buffer_len must be in (0, max_len={max_len}], got {buffer_len} "
            "(disable the overlong penalty instead of a zero buffer)"
        )
    lengths = torch.as_tensor(response_lengths, dtype=torch.float64)
    exceed = lengths - (max_len - buffer_len)
    penalty = -torch.clamp(exceed / buffer_len, min=0.0, max=1.0) * penalty_factor
    return penalty.to(torch.float32)

"""DAPO's soft overlong punishment (Yu et al., 2025, section 3.4): a response that runs into
the last `buffer_len` tokens of the generation budget loses reward linearly, up to
`penalty_factor` at `max_len`. The rollout worker adds it to each response's reward
(`algorithm.overlong_buffer_len`, `overlong_penalty_factor`).

DAPO's other group rule, dynamic sampling (drop a group whose rewards are all equal), is the
replay queue's filter `replay/filters.py:dapo_zero_variance`
(`algorithm.filter_zero_variance_groups`).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def overlong_penalty(
    response_lengths: Any, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> np.ndarray:
    """DAPO soft overlong punishment, added to the reward.

    0 for ``len <= max_len - buffer_len``, then linear down to ``-penalty_factor`` at ``max_len``
    (and held there beyond it). `response_lengths`: anything numpy reads as numbers (a list, an
    array, a CPU tensor). Returns float32 [B]. numpy: the rollout worker, which adds it, does
    not import torch.
    """
    if buffer_len <= 0 or buffer_len > max_len:
        raise ValueError(
            f"overlong buffer_len must be in (0, max_len={max_len}], got {buffer_len} "
            "(disable the overlong penalty instead of a zero buffer)"
        )
    lengths = np.asarray(response_lengths, dtype=np.float64)
    exceed = lengths - (max_len - buffer_len)
    penalty = -np.clip(exceed / buffer_len, 0.0, 1.0) * penalty_factor
    return penalty.astype(np.float32)

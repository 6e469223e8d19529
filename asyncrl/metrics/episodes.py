"""Batch metrics of environment episodes, read from the groups' metadata.

The EpisodeBuilder writes per-group counts under `env/` keys (see `multiturn.py`); here they are
summed over the batch and turned into rates, so a failed or timed-out episode is always visible
in the metrics of the step that trained on its group. Groups without these keys (single-turn
prompts) contribute nothing and the result is empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

COUNT_KEYS = (
    "env/episodes",
    "env/failed",
    "env/timeouts",
    "env/turns",
    "env/solved",
    "env/invalid_actions",
    "env/generated_tokens",
    "env/observation_tokens",
    "env/truncated",
)


def episode_metrics(groups: Sequence[Any]) -> dict[str, float]:
    totals = dict.fromkeys(COUNT_KEYS, 0.0)
    returns: list[float] = []
    for g in groups:
        meta = g.metadata
        if "env/episodes" not in meta:
            continue
        for key in COUNT_KEYS:
            totals[key] += float(meta.get(key, 0))
        returns.append(float(meta.get("env/return_sum", 0.0)))
    episodes = totals["env/episodes"]
    if not episodes:
        return {}
    valid = max(1.0, episodes - totals["env/failed"])
    tokens = max(1.0, totals["env/generated_tokens"] + totals["env/observation_tokens"])
    return {
        "env/episodes": episodes,
        "env/episodes_failed": totals["env/failed"],
        "env/step_timeouts": totals["env/timeouts"],
        "env/return_mean": sum(returns) / valid,
        "env/turns_mean": totals["env/turns"] / episodes,
        "env/solved_frac": totals["env/solved"] / valid,
        "env/truncated_frac": totals["env/truncated"] / episodes,
        "env/invalid_action_frac": totals["env/invalid_actions"] / max(1.0, totals["env/turns"]),
        "env/observation_token_frac": totals["env/observation_tokens"] / tokens,
        "env/generated_tokens": totals["env/generated_tokens"],
        "env/observation_tokens": totals["env/observation_tokens"],
    }

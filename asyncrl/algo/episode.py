"""Rewards and advantages of multi-turn episodes (one group = n episodes of one env seed).

- Episode return: the sum of the per-turn environment rewards (`sum`) or the last turn's reward
  (`final`, for environments that score only the outcome).
- `trajectory` advantages: the group estimator (grpo | drgrpo | rloo) over the n episode returns,
  one value per episode, broadcast by the rollout to every generated token of that episode.
- `per_step` advantages: turn t of an episode gets its discounted return-to-go
  `G_t = sum_{k >= t} gamma^(k-t) r_k`, normalised by the same estimator over all turns of all
  episodes of the group (the pool is the group's turns, so a turn is compared with every other
  turn of the same seed); each turn's generated tokens get the value of their turn.

Failed episodes (an environment fault) carry no signal: they are left out of every statistic and
get advantage 0. Pure functions: numbers in, arrays out (numpy: the rollout workers that call
them never import torch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from asyncrl.algo.group_advantages import AdvantageParams, one_group_advantages

RETURN_MODES = ("sum", "final")
ADVANTAGE_MODES = ("trajectory", "per_step")
EPISODE_ESTIMATORS = ("grpo", "drgrpo", "rloo")


def episode_return(turn_rewards: Sequence[float], mode: str = "sum") -> float:
    if mode not in RETURN_MODES:
        raise ValueError(f"episode return mode {mode!r} is not one of {RETURN_MODES}")
    if not turn_rewards:
        return 0.0
    return float(sum(turn_rewards)) if mode == "sum" else float(turn_rewards[-1])


def returns_to_go(turn_rewards: Sequence[float], gamma: float = 1.0) -> np.ndarray:
    """Discounted return from each turn onwards."""
    out = np.zeros(len(turn_rewards), dtype=np.float64)
    running = 0.0
    for t in range(len(turn_rewards) - 1, -1, -1):
        running = float(turn_rewards[t]) + gamma * running
        out[t] = running
    return out


def normalise(values: np.ndarray, estimator: str, norm_by_std: bool = True) -> np.ndarray:
    """One group's values through the group estimator (a single pool of values)."""
    if estimator not in EPISODE_ESTIMATORS:
        raise ValueError(f"episode advantages need one of {EPISODE_ESTIMATORS}, got {estimator!r}")
    if values.size == 0:
        return values.astype(np.float32)
    params = AdvantageParams(norm_adv_by_std_in_grpo=norm_by_std)
    return one_group_advantages(estimator, values, params)


def trajectory_advantages(
    returns: Sequence[float], valid: Sequence[bool], estimator: str, norm_by_std: bool = True
) -> np.ndarray:
    """One advantage per episode over the valid episodes' returns; 0 for the invalid ones."""
    returns, valid = np.asarray(returns, np.float64), np.asarray(valid, bool)
    out = np.zeros(len(returns), dtype=np.float32)
    out[valid] = normalise(returns[valid], estimator, norm_by_std)
    return out


def per_step_advantages(
    turn_rewards: Sequence[Sequence[float]],
    valid: Sequence[bool],
    estimator: str,
    gamma: float = 1.0,
    norm_by_std: bool = True,
) -> list[np.ndarray]:
    """Per episode, one advantage per turn: the group-normalised return-to-go of that turn."""
    togo = [returns_to_go(r, gamma) for r in turn_rewards]
    pool = [g for g, ok in zip(togo, valid, strict=True) if ok]
    flat = normalise(np.concatenate(pool) if pool else np.zeros(0), estimator, norm_by_std)
    out, start = [], 0
    for g, ok in zip(togo, valid, strict=True):
        if ok:
            out.append(flat[start : start + len(g)])
            start += len(g)
        else:
            out.append(np.zeros(len(g), dtype=np.float32))
    return out

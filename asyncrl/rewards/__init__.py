"""Verifiable rewards: ``RewardFn(prompt, response, metadata) -> float`` and their registry."""

from asyncrl.rewards.base import RewardError, RewardFn
from asyncrl.rewards.registry import builtin_rewards, check_reward, get_reward_fn, reward_names

__all__ = [
    "RewardError",
    "RewardFn",
    "builtin_rewards",
    "check_reward",
    "get_reward_fn",
    "reward_names",
]

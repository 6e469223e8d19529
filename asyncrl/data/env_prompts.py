"""Prompts of environment runs: one row per env seed.

`PromptSource` treats these rows like a dataset: keys `e<epoch>-i<index>` stay unique over the
run (a seed seen again in a later epoch is a new prompt), the order is reshuffled every epoch
from the run seed, and the position is part of every checkpoint, so env runs resume exactly.
The episode builder resets the environment with `env_seed`; the prompt ids come from there.
"""

from __future__ import annotations

from typing import Any

from asyncrl.config.schema import ConfigError, EnvConfig
from asyncrl.envs import EnvError, make_env


def check_env(env: EnvConfig) -> None:
    """Build the environment once where the run starts, so that a bad name, path or config
    fails there with one line instead of failing every episode in the rollout workers."""
    try:
        instance = make_env(env.name, env.config)
    except EnvError as e:
        raise ConfigError(f"env: {e}") from None
    close = getattr(instance, "close", None)
    if callable(close):
        close()


def seed_rows(env: EnvConfig) -> list[dict[str, Any]]:
    check_env(env)
    return [{"env_seed": env.seed_offset + i} for i in range(env.num_seeds)]

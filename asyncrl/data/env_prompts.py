"""Prompts of environment runs: one row per env seed.

`PromptSource` treats these rows like a dataset: keys `e<epoch>-i<index>` stay unique over the
run (a seed seen again in a later epoch is a new prompt), the order is reshuffled every epoch
from the run seed, and the position is part of every checkpoint, so env runs resume exactly.
The episode builder resets the environment with `env_seed`; the prompt ids come from there.

Held-out seeds (evaluation, `rollout/evaluation.py`) are `HELDOUT_SEED_BASE + i`, the same for
every evaluation of a run and for every run whose training range stays below the base (curves
are comparable across runs); a training range reaching the base moves them just past its end.
Either way they are disjoint from the training seeds `seed_offset .. seed_offset + num_seeds -
1`: the episodes evaluated are never ones trained on (for an env whose seed picks from a small
set of instances, such as guess_number's ten secrets, the seeds differ but the instances can
repeat: what is held out is the seed).
"""

from __future__ import annotations

from typing import Any

from asyncrl.config.schema import ConfigError, EnvConfig
from asyncrl.envs import EnvError, make_env

#: First held-out seed: far above any training range a config uses in practice (the default
#: is 0 .. 99999) and below 2**31, so environments that need a 32-bit seed take it.
HELDOUT_SEED_BASE = 1_000_000_000


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


def heldout_seeds(env: EnvConfig, n: int) -> list[int]:
    """The `n` held-out env seeds of a run: fixed, and disjoint from the training seeds."""
    start = max(HELDOUT_SEED_BASE, env.seed_offset + env.num_seeds)  # past any training seed
    return list(range(start, start + n))


def heldout_seed_rows(env: EnvConfig, n: int) -> list[dict[str, Any]]:
    """One prompt row per held-out seed, as `seed_rows` gives the training ones."""
    check_env(env)
    return [{"env_seed": seed} for seed in heldout_seeds(env, n)]

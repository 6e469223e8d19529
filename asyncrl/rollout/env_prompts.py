"""Prompts of environment runs: one row per env seed.

`PromptSource` treats these rows like a dataset: keys `e<epoch>-i<index>` stay unique over the
run (a seed seen again in a later epoch is a new prompt), the order is reshuffled every epoch
from the run seed, and the position is part of every checkpoint, so env runs resume exactly.
The episode builder resets the environment with `env_seed`; the prompt ids come from there.
"""

from __future__ import annotations

from typing import Any

from asyncrl.config.schema import EnvConfig


def seed_rows(env: EnvConfig) -> list[dict[str, Any]]:
    return [{"env_seed": env.seed_offset + i} for i in range(env.num_seeds)]

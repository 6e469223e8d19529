"""Environment idioms for the embedded model's warm-start corpus (`model_args.warm_start_mix`).

A pretraining mix holds text of many kinds; the embedded model's holds only arithmetic, so an
environment whose turns it has never seen gets mostly invalid actions and groups without
reward variance: nothing for RL to learn from. A mix adds an environment's *idiom* — what its
turns look like and which answers are valid moves — and never how to win it:

- ``frozenlake``: episodes of FrozenLake (`envs/frozenlake.py`, 4x4 random maps, half of them
  slippery) played by the uniformly random policy, rendered exactly as a run with
  ``env.template: none`` shows them (the instructions, the grid, the action list; after each
  move the new grid). Only the moves are learned (the loss masks everything else), so the model
  learns to answer a valid move with the random policy's odds; the maps come from a seed range
  no run trains or evaluates on, and the corpus holds no solution: a random walk reaches the
  goal in about 1 % of its episodes, which are kept like any other (filtering for them would
  be teaching the solution). What RL then has to learn is which move to make.
"""

from __future__ import annotations

import random
from typing import Any

#: The mixes there are; `config.schema.ModelArgs.warm_start_mix` enumerates the same names.
MIXES = ("frozenlake",)

#: Map seeds of the corpus: above the held-out seeds (`data/env_prompts.HELDOUT_SEED_BASE`, 1e9)
#: and far above any training range, below 2**31 for gymnasium's seeding.
CORPUS_SEED_BASE = 1_500_000_000

#: Map seeds of the built model's report (valid first moves on maps the corpus never held).
REPORT_SEED_BASE = 1_400_000_000

#: Moves per corpus episode at most (a 4x4 lake needs 6; runs give 10-12 turns).
FROZENLAKE_MAX_TURNS = 12

Example = tuple[list[int], list[int]]  # (input_ids, labels), labels -100 where not learned


def canonical(mix: Any) -> tuple[str, ...]:
    """The mix as a sorted tuple of distinct names (the cache key must not depend on order);
    an unknown name is a ValueError naming it."""
    names = tuple(sorted({str(m) for m in mix}))
    unknown = [m for m in names if m not in MIXES]
    if unknown:
        raise ValueError(f"warm_start_mix: unknown {unknown} (known: {', '.join(MIXES)})")
    return names


def frozenlake_episode(
    tokenizer: Any, seed: int, rng: random.Random, max_turns: int = FROZENLAKE_MAX_TURNS
) -> Example:
    """One random-policy FrozenLake episode as the model sees it in a run with
    ``env.template: none``; labels only on the moves (and their EOS)."""
    from asyncrl.envs.base import as_messages
    from asyncrl.envs.frozenlake import ACTIONS, FrozenLakeEnv
    from asyncrl.rollout.chat_tokens import TurnTemplate

    template, eos = TurnTemplate(tokenizer, "none"), tokenizer.eos_token_id
    env = FrozenLakeEnv(is_slippery=rng.random() < 0.5)
    try:
        ids = template.prompt_ids(as_messages(env.reset(seed)))
        labels = [-100] * len(ids)
        for turn in range(max_turns):
            action = rng.choice(ACTIONS)
            move = [*template.encode(action), eos]
            ids, labels = ids + move, labels + move
            obs, _, done, _ = env.step(action)
            if done or turn + 1 == max_turns:
                break
            seen = template.observation_ids(as_messages(obs), eos)
            ids, labels = ids + seen, labels + [-100] * len(seen)
    finally:
        env.close()
    return ids, labels


def corpus(tokenizer: Any, mix: tuple[str, ...], episodes: int, seed: int) -> list[Example]:
    """The examples of every mix in ``mix`` (``episodes`` each), deterministic in ``seed``."""
    out: list[Example] = []
    for name in canonical(mix):
        rng = random.Random(f"{seed}:{name}")
        if name == "frozenlake":
            out += [
                frozenlake_episode(tokenizer, CORPUS_SEED_BASE + i, rng) for i in range(episodes)
            ]
    return out


def frozenlake_prompts(n: int) -> list[str]:
    """First observations of ``n`` maps outside the corpus (the built model's report)."""
    from asyncrl.envs.frozenlake import FrozenLakeEnv

    env = FrozenLakeEnv()
    try:
        return [env.reset(REPORT_SEED_BASE + i) for i in range(n)]
    finally:
        env.close()


def report(model: Any, tokenizer: Any, mix: tuple[str, ...]) -> dict[str, float]:
    """What the built model learned of each mix's idiom, for its report: with ``frozenlake``
    the share of greedy first moves on unseen maps that FrozenLake reads as a move."""
    from asyncrl.envs.frozenlake import ACTIONS
    from asyncrl.envs.gym_adapter import parse_action
    from asyncrl.models.generate import greedy_responses

    out: dict[str, float] = {}
    if "frozenlake" in mix:
        moves = greedy_responses(model, tokenizer, frozenlake_prompts(64), max_new_tokens=6)
        valid = [parse_action(m, ACTIONS, len(ACTIONS)) is not None for m in moves]
        out["frozenlake_valid_first_moves"] = sum(valid) / len(valid)
    return out

"""`actor_train.model_args.warm_start_mix`: environment idioms in the embedded model's warm-start.

The default model must stay the one it was (its cache key and its warm-start batches); a mix is
another model under its own key; the FrozenLake corpus is random-policy play in exactly the text
a run with `env.template: none` shows, with only the moves learned.
"""

from __future__ import annotations

import json
import random
import typing
from collections import Counter

import pytest

from asyncrl.config import ConfigError
from asyncrl.config.loader import load_config
from asyncrl.config.schema import ModelArgs
from asyncrl.data.env_prompts import HELDOUT_SEED_BASE
from asyncrl.envs.frozenlake import ACTIONS, FrozenLakeEnv
from asyncrl.models import mix, tiny
from asyncrl.models import warm_start as warm
from asyncrl.models.tiny import (
    DEFAULT_SPEC,
    MARKER,
    TinyModelSpec,
    build_tokenizer,
    embedded_spec,
    ensure_embedded_model,
)

#: The default model's cache key before mixes existed (the README's figures are of that model).
DEFAULT_DIGEST = "777d9d693780d553"


def test_the_default_model_keeps_its_cache_key():
    assert DEFAULT_SPEC.digest() == DEFAULT_DIGEST
    assert embedded_spec([]) is DEFAULT_SPEC and embedded_spec(()) is DEFAULT_SPEC


def test_a_mix_is_another_model_whatever_its_order(monkeypatch):
    lake = embedded_spec(["frozenlake"])
    assert lake.mix == ("frozenlake",) and lake.digest() != DEFAULT_DIGEST
    assert embedded_spec(["frozenlake", "frozenlake"]).digest() == lake.digest()
    assert TinyModelSpec(mix=("frozenlake",), mix_fraction=0.5).digest() != lake.digest()
    before = lake.digest()
    monkeypatch.setattr(tiny, "MIX_VERSION", tiny.MIX_VERSION + 1)
    assert lake.digest() != before and DEFAULT_SPEC.digest() == DEFAULT_DIGEST
    with pytest.raises(ValueError, match="unknown \\['sokoban'\\]"):
        embedded_spec(["sokoban"])


def _old_batches(spec: TinyModelSpec, pools: dict) -> list:
    """The warm-start's batch order before mixes existed (the loop it had inline)."""
    rng, out = random.Random(spec.seed), []
    for _ in range(spec.steps):
        pool = pools["native" if rng.random() < spec.chat_fraction else "none"]
        out.append([pool[rng.randrange(len(pool))] for _ in range(spec.batch_size)])
    return out


def test_without_a_mix_the_warm_start_batches_are_the_old_ones():
    spec = TinyModelSpec(steps=300, batch_size=8, chat_fraction=0.3)
    pools = {"none": list(range(100)), "native": list(range(100, 150))}
    assert list(warm.training_batches(spec, pools, [])) == _old_batches(spec, pools)
    mixed = list(
        warm.training_batches(TinyModelSpec(**{**spec.__dict__, "mix_fraction": 0.25}), pools, [-1])
    )
    share = sum(b[0] == -1 for b in mixed) / len(mixed)
    assert 0.15 < share < 0.35 and all(len(b) == 16 for b in mixed if b[0] == -1)


def test_the_config_field_names_the_mixes_there_are():
    hints = typing.get_type_hints(ModelArgs)
    (item,) = typing.get_args(hints["warm_start_mix"])
    assert typing.get_args(item) == mix.MIXES
    assert ModelArgs().warm_start_mix == []


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["actor_train.model_args.warm_start_mix=[sokoban]"], "is not one of frozenlake"),
        (["actor_train.model_args.warm_start_mix=frozenlake"], "expected a list"),
        (
            [
                "actor_train.model_args.warm_start_mix=[frozenlake]",
                "actor_train.model_args.model_name_or_path=/some/model",
            ],
            "read on actor_train only and with an empty model_name_or_path",
        ),  # fmt: skip
        (
            ["actor_infer.model_args.warm_start_mix=[frozenlake]"],
            "actor_infer.model_args.warm_start_mix: mixes the embedded model",
        ),
    ],
)
def test_validation_refuses_a_mix_that_would_not_be_built(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_the_frozenlake_config_uses_the_mix():
    cfg = load_config("configs/agentic_frozenlake.yaml")
    assert cfg.actor_train.model_args.warm_start_mix == ["frozenlake"]
    assert cfg.env.template == "none"  # the idiom the corpus is rendered in
    assert cfg.env.max_turns >= 2 * (cfg.env.config["size"] - 1)  # the goal is reachable


def _replay(tok, seed: int, moves: list[str]) -> str:
    """The text a run with `env.template: none` shows for these moves (each ending in EOS)."""
    env = FrozenLakeEnv(is_slippery=False)
    text = env.reset(seed)
    for i, move in enumerate(moves):
        text += move + tok.eos_token
        obs, _, done, _ = env.step(move)
        if not done and i + 1 < len(moves):
            text += obs
    return text


def test_frozenlake_corpus_is_random_play_in_the_run_idiom():
    tok = build_tokenizer()
    examples = mix.corpus(tok, ("frozenlake",), 300, seed=0)
    assert examples == mix.corpus(tok, ("frozenlake",), 300, seed=0)  # deterministic
    moves: Counter[str] = Counter()
    first_prompts = set()
    for ids, labels in examples:
        assert len(ids) == len(labels) <= tiny.DEFAULT_SPEC.max_position_embeddings
        learned = tok.decode([t for t, y in zip(ids, labels) if y != -100])
        turns = learned.split(tok.eos_token)[:-1]
        assert learned.endswith(tok.eos_token) and set(turns) <= set(ACTIONS)  # moves only
        assert 1 <= len(turns) <= mix.FROZENLAKE_MAX_TURNS
        moves.update(turns)
        first_prompts.add(tok.decode(ids[: labels.index(next(y for y in labels if y != -100))]))
    # the uniform random policy, not a solver: every move about a quarter of the time
    total = sum(moves.values())
    assert all(0.2 < moves[a] / total < 0.3 for a in ACTIONS), moves
    assert len(first_prompts) > 150  # a random map per episode (4x4 maps do repeat)
    # the map seeds lie outside every training range and the held-out seeds
    assert mix.CORPUS_SEED_BASE > HELDOUT_SEED_BASE + 10**8 and mix.CORPUS_SEED_BASE < 2**31


def test_a_corpus_episode_is_the_text_of_that_play_in_the_env():
    tok = build_tokenizer()
    rng, checked = random.Random(5), 0
    for seed in range(40):
        slippery = random.Random()
        slippery.setstate(rng.getstate())  # the episode's first draw picks the dynamics
        ids, labels = mix.frozenlake_episode(tok, seed, rng)
        moves = tok.decode([t for t, y in zip(ids, labels) if y != -100]).split(tok.eos_token)
        if slippery.random() < 0.5:
            continue  # a slippery episode's moves do not replay deterministically
        assert tok.decode(ids) == _replay(tok, seed, moves[:-1])
        checked += 1
    assert checked >= 10


SMALL_MIX = TinyModelSpec(
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    train_rows=256,
    heldout_rows=16,
    steps=12,
    batch_size=16,
    mix=("frozenlake",),
    mix_episodes=40,
    mix_fraction=0.5,
    mix_batch_size=4,
)


def test_a_mixed_model_builds_under_its_own_key(tmp_path):
    path = ensure_embedded_model(tmp_path, SMALL_MIX, verbose=False)
    plain = TinyModelSpec(**{**SMALL_MIX.__dict__, "mix": ()})
    assert path.name == f"embedded-{SMALL_MIX.digest()}" and SMALL_MIX.digest() != plain.digest()
    report = json.loads((path / MARKER).read_text())
    assert report["spec"]["mix"] == ["frozenlake"] and report["mix_version"] == tiny.MIX_VERSION
    assert 0.0 <= report["frozenlake_valid_first_moves"] <= 1.0

"""The real loop on an environment (shrunk like tests/test_e2e.py): Ray rollout actors run
multi-turn guess-the-number episodes through the hf engine, ZMQ carries the groups, the torch
learner trains on them with observation tokens masked out. Nothing is faked."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.run import run


def test_env_loop_end_to_end(tiny_model, tmp_path):
    cfg = load_config(
        None,
        [
            f"actor_train.model_args.model_name_or_path={tiny_model}",
            f"output_dir={tmp_path}",
            "max_steps=3",
            "rollout_batch_size=2",
            "num_return_sequences_in_group=3",
            "response_length=96",
            "rollout.num_actors=2",
            "rollout.max_inflight_prompts=2",
            "logging.eval_interval=0",
            "logging.console=false",
            "logging.tensorboard=false",
            "actor_train.training_args.learning_rate=1e-3",
            "actor_train.model_args.disable_gradient_checkpointing=true",
            "env.name=guess_number",
            "env.config={max_guesses: 3}",
            "env.max_turns=3",
            "env.max_tokens_per_turn=4",
        ],
    )
    summary = run(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("version") is not None]
    assert len(rows) == 3 and summary["groups_trained"] == 6
    for r in rows:
        # episodes flowed: 2 groups x 3 episodes per step, several turns each
        assert r["env/episodes"] == 6 and r["env/episodes_failed"] == 0
        assert r["env/turns_mean"] > 1
        # masks applied: the learner trained on exactly the generated tokens, and the
        # observation tokens between turns (present in every multi-turn episode) were masked
        assert r["env/observation_tokens"] > 0
        assert r["learner/tokens"] == r["env/generated_tokens"]
        assert math.isfinite(r["mismatch/mismatch_kl"])
    assert rows[-1]["rollout/policy_version_max"] >= 1


def _window_mean(rows: list[dict], key: str, start: int, end: int | None) -> float:
    values = [r[key] for r in rows[start:end]]
    return sum(values) / len(values)


@pytest.mark.slow
def test_guess_number_recipe_learns_without_collapse(tmp_path):
    """Issue 18, the shipped recipe as a user runs it (the embedded model, seed 0, 150 steps):
    episode success rises well above the warm-start and the policy does not collapse onto one
    answer (its entropy stays near its start; answers stay valid)."""
    recipe = Path(__file__).parents[1] / "configs/agentic_guess_number.yaml"
    overrides = [f"output_dir={tmp_path}", "logging.console=false", "logging.tensorboard=false"]
    run(load_config(recipe, overrides))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "env/solved_frac" in r]
    assert len(rows) == 150
    first = _window_mean(rows, "env/solved_frac", 0, 15)
    last = _window_mean(rows, "env/solved_frac", -15, None)
    # the recipe's header claims >= 0.55 on seeds 0-2 (measured 0.63-0.76); a looser bar here
    assert last >= 0.5 and last >= first + 0.2, (first, last)
    start_entropy = _window_mean(rows, "actor/entropy", 0, 3)
    # a sharpening policy loses entropy (measured: to 0.36-0.43 of its start); a collapsed one
    # to ~0.06
    assert _window_mean(rows, "actor/entropy", -15, None) >= 0.25 * start_entropy
    assert _window_mean(rows, "env/invalid_action_frac", -15, None) < 0.1

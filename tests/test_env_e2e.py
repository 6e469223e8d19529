"""The real loop on an environment (shrunk like tests/test_e2e.py): Ray rollout actors run
multi-turn guess-the-number episodes through the hf engine, ZMQ carries the groups, the torch
learner trains on them with observation tokens masked out. Nothing is faked."""

from __future__ import annotations

import json
import math

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

"""The real loop on a shrunk default: Ray, 2 rollout actors, an hf engine server, ZMQ, the
replay queue, the torch learner and gloo weight sync. Nothing is faked."""

from __future__ import annotations

import json
import math

import pytest

from asyncrl.config import load_config
from asyncrl.models.tiny import TinyModelSpec, build_model, build_tokenizer
from asyncrl.run import run


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    tok = build_tokenizer()
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4)
    build_model(spec, tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def shrunk(model_dir, out, *extra):
    return load_config(
        None,
        [
            f"actor_train.model_args.model_name_or_path={model_dir}",
            f"output_dir={out}",
            "max_steps=4",
            "rollout_batch_size=2",
            "num_return_sequences_in_group=3",
            "response_length=6",
            "rollout.num_actors=2",
            "rollout.max_inflight_prompts=2",
            "logging.eval_size=8",
            "logging.eval_interval=2",
            "logging.console=false",
            "logging.tensorboard=false",
            "actor_train.training_args.learning_rate=1e-3",
            "actor_train.model_args.disable_gradient_checkpointing=true",
            *extra,
        ],
    )


def read_rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_async_loop_end_to_end(tiny_model, tmp_path):
    cfg = shrunk(tiny_model, tmp_path, "async.max_staleness=1")
    summary = run(cfg)
    rows = [r for r in read_rows(tmp_path) if r.get("version") is not None]
    assert len(rows) == 4 and rows[-1]["version"] == 4
    # trajectories flowed through ZMQ into the queue and were trained on
    assert rows[-1]["transport/received"] >= 4 * 2
    assert summary["groups_trained"] == 8
    # the engines' weight versions advanced with the learner's
    assert rows[-1]["rollout/policy_version_max"] >= 2
    assert all(r["sync/seconds"] > 0 for r in rows)
    # the staleness bound held for every trained group
    assert all(r["replay/staleness_max"] <= 1 for r in rows)
    # rollout IS metrics present and finite
    for r in rows:
        for key in ("mismatch/mismatch_kl", "mismatch/rollout_is_eff_sample_size"):
            assert key in r and r[key] is not None and math.isfinite(r[key])
    assert (tmp_path / "checkpoints" / "latest").exists()
    assert (tmp_path / "plots").is_dir()

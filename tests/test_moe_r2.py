"""Routing replay r2 in the torch learner: its old-policy pass (the proximal logprobs' no-grad
recompute) records each position's routes and the update's forwards replay them, so the
ratio's numerator routes like its denominator (verl's R2). On a random tiny Qwen3-MoE whose
routers are drawn wide (`tests/moe_fixtures.py`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.learner.collate import collate
from asyncrl.learner.logprobs import token_logprobs
from asyncrl.learner.torch.learner import TorchLearner
from asyncrl.moe import UNROUTED, tap_of
from asyncrl.types import TrajectoryGroup
from tests.moe_fixtures import random_moe


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    random_moe(path)
    return path


def _groups(same_lengths: bool, n_groups: int = 2, n: int = 4) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(0)
    groups = []
    for g in range(n_groups):
        responses = []
        for i in range(n):
            length = 5 if same_lengths else int(rng.integers(1, 8))
            responses.append({
                "response_ids": rng.integers(5, 90, length),
                "rollout_logprobs": -rng.random(length) * 3,
                "versions": np.zeros(length, dtype=np.int64), "reward": float(i % 2),
                "finish_reason": "stop",
                "advantages": np.full(length, 1.0 if i % 2 else -1.0),
            })  # fmt: skip
        prompt = rng.integers(5, 90, 6 if same_lengths else 3 + 2 * g)
        groups.append(TrajectoryGroup.from_responses(f"g{g}", prompt, responses))
    return groups


def _learner(moe_dir, replay: str, *overrides: str) -> TorchLearner:
    cfg = load_config(None, [
        "actor_train.model_args.disable_gradient_checkpointing=true",
        "actor_train.training_args.learning_rate=0.05", f"actor.router_replay={replay}",
        "actor_train.model_args.embedded_arch=moe", *overrides,
    ])  # fmt: skip
    return TorchLearner(moe_dir, cfg.actor_train, cfg.actor, cfg.algorithm, temperature=1.0,
                        total_steps=10)  # fmt: skip


def test_the_update_replays_exactly_the_routes_the_old_policy_pass_recorded(moe_dir):
    learner = _learner(moe_dir, "r2", "actor_train.infer_batch_size=3")  # chunks, each trimmed
    data = collate(_groups(same_lengths=False)).to_torch()
    data["response_mask"] = data["response_mask"].float()
    assert "routes" not in data  # r2: no engine returns routes
    prep, _ = learner._prepare(data)
    recorded = data["routes"]
    real = data["attention_mask"].bool()
    assert bool((recorded[real] != UNROUTED).all())  # every token the pass forwarded
    tap = tap_of(learner.model)
    tap.reset_stats()
    with torch.no_grad(), tap.recording_routes():
        logp, _ = token_logprobs(learner.model, data, 1.0)  # an update forward's routing
        used = tap.take().view(recorded.shape)
    assert torch.equal(used[real], recorded[real])  # the experts the forward used: recorded
    stats = tap.reset_stats()
    # replayed: every position the pass recorded (padding a chunk trimmed off routes itself)
    assert stats["replayed"] == int((recorded != UNROUTED).all(-1).sum()) * tap.layers
    mask = data["response_mask"] > 0
    torch.testing.assert_close(logp[mask], prep["old"][mask])  # the same policy, routed alike


def test_r2s_ratio_before_any_update_is_exactly_one(moe_dir):
    # one chunk and one micro-batch of the whole batch, nothing to trim: the old pass and the
    # first update forward are the same forward, routed alike
    rows = "actor_train.training_args.per_device_train_batch_size=8"
    learner = _learner(moe_dir, "r2", "actor_train.infer_batch_size=8", rows)
    metrics = learner.step(_groups(same_lengths=True))
    assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/clipfrac"] == 0.0
    assert metrics["learner/router_replayed_frac"] == 1.0  # every update forward replayed


def test_later_mini_batches_route_as_the_old_policy_while_the_routers_move(moe_dir):
    # two mini-batches: the second runs after an optimizer step moved the routers; r2 keeps
    # the old pass's experts for it (its own top-k differs somewhere), off routes anew
    two = ["actor.ppo_mini_batch_size=4", "actor_train.training_args.learning_rate=0.5"]
    metrics = _learner(moe_dir, "r2", *two).step(_groups(same_lengths=True))  # no padding
    assert metrics["learner/router_replayed_frac"] == 1.0
    assert metrics["learner/router_differ_frac"] > 0


@pytest.mark.parametrize(
    "overrides,problem",
    [
        (["actor.router_replay=r2"], "r2 needs a mixture-of-experts policy"),
        (["actor.router_replay=r2", "actor_train.model_args.embedded_arch=moe",
          "algorithm.correction_mode=bypass"], "correction_mode bypass runs none"),
        (["actor.router_replay=r2", "actor_train.model_args.embedded_arch=moe",
          "actor_train.strategy_args.strategy_name=megatron_train"], "fsdp2_train learner"),
        (["actor.router_replay=r2", "actor_train.model_args.embedded_arch=moe",
          "actor.use_dynamic_bsz=true"], "r2 replays routes in the padded forward"),
        (["actor.router_replay=r2", "actor_train.model_args.embedded_arch=moe",
          "actor_train.model_args.disable_gradient_checkpointing=false"], "checkpointing off"),
    ],
)  # fmt: skip
def test_r2_is_refused_where_the_learner_cannot_honour_it(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(None, overrides)


def test_r2_validates_on_the_embedded_moe_with_any_engine():
    cfg = load_config(None, ["actor.router_replay=r2", "actor_train.model_args.embedded_arch=moe",
                             "actor_infer.strategy_args.strategy_name=sglang"])  # fmt: skip
    assert cfg.actor.router_replay == "r2"


@pytest.mark.slow
def test_r2_trains_through_the_real_loop(tmp_path):
    """The loop with r2: engines return no routes, the learner's old-policy pass records them
    and every update forward replays them."""
    from asyncrl.run import run
    from tests.test_e2e import read_rows, shrunk

    model_dir = tmp_path / "moe"
    random_moe(model_dir)
    out = tmp_path / "run"
    cfg = shrunk(model_dir, out, "actor.router_replay=r2", "logging.eval_interval=0",
                 "actor_train.training_args.learning_rate=1e-2", "max_steps=2")  # fmt: skip
    run(cfg)
    rows = [r for r in read_rows(out) if r.get("version") is not None]
    assert len(rows) == 2
    for r in rows:
        assert r["learner/router_replayed_frac"] > 0.9  # all but padding the pass trimmed off
        assert math.isfinite(r["actor/pg_loss"])

"""The real loop on a mixture-of-experts policy with rollout routing replay (R3): Ray, rollout
actors, an hf engine that returns routed experts, ZMQ, the replay queue, the torch learner
replaying them, gloo weight sync carrying the experts' weights. Nothing is faked."""

from __future__ import annotations

import math

from asyncrl.run import run
from tests.moe_fixtures import random_moe
from tests.test_e2e import read_rows, shrunk


def test_moe_policy_trains_with_replayed_routes_and_synced_experts(tmp_path):
    model_dir = tmp_path / "moe"
    random_moe(model_dir)
    out = tmp_path / "run"
    # synchronous: each batch comes from the weights just synced, so a route or logprob the
    # learner disagrees on would be a weight the sync did not carry (experts, routers)
    cfg = shrunk(model_dir, out, "async.max_staleness=0", "actor.router_replay=r3",
                 "actor_train.training_args.learning_rate=1e-2", "logging.eval_interval=0")  # fmt: skip
    summary = run(cfg)
    rows = [r for r in read_rows(out) if r.get("version") is not None]
    assert len(rows) == 4 and summary["groups_trained"] == 8
    for r in rows:
        # most (token, layer) pairs replay the engine's experts (not: each row's last token)
        assert r["learner/router_replayed_frac"] > 0.5
        # fp32 on both sides: the learner's own top-k agrees with the engine's (near-ties aside)
        assert r["learner/router_differ_frac"] < 0.02
        # the synced weights (experts and routers included) are the learner's: no mismatch
        assert math.isfinite(r["mismatch/mismatch_kl"]) and abs(r["mismatch/mismatch_kl"]) < 1e-4
    assert rows[-1]["rollout/policy_version_max"] == 3  # the engines got every new version


def test_moe_episodes_replay_their_turns_routes(tmp_path):
    """Multi-turn: each turn's request returns the routes of the whole history, the episode
    keeps each position's first; the learner's own routing (fp32, synced) then agrees with
    them, which it would not if any turn's rows were misplaced."""
    model_dir = tmp_path / "moe"
    random_moe(model_dir)
    out = tmp_path / "run"
    cfg = shrunk(model_dir, out, "async.max_staleness=0", "actor.router_replay=r3",
                 "logging.eval_interval=0", "max_steps=2", "env.name=guess_number",
                 "env.config={max_guesses: 2}", "env.max_turns=2", "env.max_tokens_per_turn=4",
                 "response_length=48")  # fmt: skip
    run(cfg)
    rows = [r for r in read_rows(out) if r.get("version") is not None]
    assert len(rows) == 2
    for r in rows:
        assert r["learner/router_replayed_frac"] > 0.5
        assert r["learner/router_differ_frac"] < 0.02
        assert abs(r["mismatch/mismatch_kl"]) < 1e-4

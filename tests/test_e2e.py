"""The real loop on a shrunk default: Ray, 2 rollout actors, an hf engine server, ZMQ, the
replay queue, the torch learner and gloo weight sync. Nothing is faked."""

from __future__ import annotations

import json
import math

from asyncrl.config import load_config
from asyncrl.run import run


def shrunk(model_dir, out, *extra):
    return load_config(None, shrunk_overrides(model_dir, out, *extra))


def shrunk_overrides(model_dir, out, *extra):
    """The shrunk default as `key=value` overrides (a CLI run takes the same)."""
    return [
        f"actor_train.model_args.model_name_or_path={model_dir}",
        f"output_dir={out}",
        "max_steps=4",
        "rollout_batch_size=2",
        "num_return_sequences_in_group=3",
        "response_length=6",
        "rollout.num_actors=2",
        "rollout.max_inflight_prompts=2",
        "logging.eval_size=8",
        "rollout.reward_fn=tests.e2e_rewards:digit_fraction",
        "logging.eval_interval=2",
        "logging.console=false",
        "logging.tensorboard=false",
        "actor_train.training_args.learning_rate=1e-3",
        "actor_train.model_args.disable_gradient_checkpointing=true",
        *extra,
    ]


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


def _reference_run(cfg, model_dir, steps):
    """A plain synchronous loop over the same parts minus Ray, ZMQ, the queue and the
    dispatcher: generate a batch, train on it, push the weights, repeat."""
    import asyncio

    from asyncrl.data.prompts import PromptSource
    from asyncrl.engine.client import EngineClient
    from asyncrl.engine.hf.launch import launch_hf_server
    from asyncrl.learner.torch.learner import TorchLearner
    from asyncrl.rollout.single_turn import GroupBuilder
    from asyncrl.startup import rollout_settings
    from asyncrl.weights.sync import WeightSender

    gen = cfg.actor_infer.generating_args
    learner = TorchLearner(
        model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, gen.temperature,
        total_steps=cfg.max_steps, seed=cfg.seed,
    )  # fmt: skip
    source = PromptSource(cfg, model_dir)

    async def loop(url):
        client, sender = EngineClient(url), WeightSender()
        await sender.init_group([client])
        await sender.sync(learner.weights_for_sync(), learner.version)
        builder = GroupBuilder(rollout_settings(cfg, model_dir, [url]))
        for _ in range(steps):
            items = [source.next_item() for _ in range(cfg.rollout_batch_size)]
            groups = await asyncio.gather(*(builder.build(it) for it in items))
            learner.step(list(groups))
            await sender.sync(learner.weights_for_sync(), learner.version)
        await sender.close()
        await client.close()

    with launch_hf_server(model_dir, seed=cfg.seed) as handle:
        asyncio.run(loop(handle.url))
    return learner


def test_sync_mode_equals_plain_synchronous_reference(tiny_model, tmp_path):
    import torch

    steps = 3
    cfg = shrunk(tiny_model, tmp_path, "async.max_staleness=0", f"max_steps={steps}")
    run(cfg)
    state = torch.load(tmp_path / "checkpoints" / f"step_{steps}" / "learner.pt", weights_only=True)
    reference = _reference_run(cfg, tiny_model, steps)
    assert state["version"] == reference.version == steps
    from safetensors.torch import load_file

    initial = load_file(tiny_model / "model.safetensors")
    ref_params = reference.model.state_dict()
    for name, value in state["model"].items():
        torch.testing.assert_close(value, ref_params[name], atol=1e-5, rtol=1e-4, msg=name)
    # ... and training really moved the weights, so the equality is not trivial
    moved = max(float((state["model"][k] - v).abs().max()) for k, v in initial.items())
    assert moved > 1e-4


def test_bf16_engine_mismatch_is_measured_and_corrected(tiny_model, tmp_path):
    """A bf16 engine against the fp32 learner: the mismatch is real (non-zero KL, ESS < 1) and
    the IS weights that correct it are applied (truncated at the threshold)."""
    cfg = shrunk(
        tiny_model, tmp_path, "max_steps=2", "actor_infer.model_args.dtype=bf16",
        "algorithm.rollout_is_threshold=1.001", "logging.eval_interval=0",
    )  # fmt: skip
    run(cfg)
    rows = [r for r in read_rows(tmp_path) if r.get("version") is not None]
    for r in rows:
        assert abs(r["mismatch/mismatch_kl"]) > 1e-6 and r["mismatch/mismatch_k3_kl"] > 0
        assert r["mismatch/rollout_is_eff_sample_size"] < 1.0
    # the correction bit: weights above the bound were truncated (a step of only a few short
    # responses may by chance have none above 1.001, so this is asserted over the run)
    assert any(r["mismatch/rollout_is_truncated_fraction"] > 0 for r in rows)

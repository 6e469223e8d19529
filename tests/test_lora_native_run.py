"""`lora_sync: native` through the run's own code: the real EngineFleet, and the real loop
(`asyncrl.run.run`), on fake SGLang engines (tests/fake_sglang). Both skip, saying so, until
EngineFleet takes `lora` (the wiring in engine/fleet.py, run.py and rollout/ of issue 17)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.engine.client import EngineClient, GenerateRequest
from asyncrl.weights.sync import WeightSyncError
from tests.fake_sglang.fake_lora import adapter_logprob
from tests.test_lora_learner import _learner, _train_a_step
from tests.test_lora_native import WEIGHTS, start_lora_fake
from tests.test_sglang_backend import fake_env, infer_cfg, state


# ---- through the real EngineFleet (the run's sync path) ----------------------------------------
def _fleet_wired() -> bool:
    import inspect

    from asyncrl.engine.fleet import EngineFleet

    return "lora" in inspect.signature(EngineFleet.__init__).parameters


@pytest.mark.skipif(
    not _fleet_wired(), reason="EngineFleet(lora=...) not wired yet: see issue 17's notes"
)
def test_fleet_syncs_the_learners_adapter_by_name(tmp_path, tiny_model, monkeypatch):
    """The real EngineFleet with a LoRA learner on two fake SGLang engines behind the router:
    launched with LoRA on, each sync loads asyncrl-v{version} (the learner's own adapter: its
    bytes, not the model's), requests name it, the previous one is unloaded; a refused load
    fails that sync in one line, the engines keep serving the previous adapter, the next works."""
    from asyncrl.engine.fleet import EngineFleet
    from asyncrl.net import AsyncRunner
    from asyncrl.weights.lora_native import native_lora

    monkeypatch.setenv("ASYNCRL_DEVICE", "cpu")
    env = {**fake_env()["env"], "FAKE_SGLANG_LORA_REFUSE": "asyncrl-v2"}
    cfg = infer_cfg(
        tmp_path, tp=1, devices="[0,1]", **fake_env(env=env, router_policy="round_robin")
    )
    cfg.actor_train.model_args.lora_rank = 4  # the learner's (tests.test_lora_learner)
    cfg.weight_sync.lora_sync, cfg.weight_sync.timeout_s = "native", 60
    lora = native_lora(cfg.weight_sync, cfg.actor_train.model_args, cfg.output_dir)
    learner, runner = _learner(tiny_model), AsyncRunner()
    fleet = EngineFleet(
        cfg.actor_infer, cfg.weight_sync, "in_place", tiny_model, Path(cfg.output_dir),
        seed=0, request_timeout_s=30, runner=runner, lora=lora,
    )  # fmt: skip
    lora_dir = tmp_path / "lora_adapters"

    async def generate(worker: EngineClient, version: int) -> None:
        want = adapter_logprob(lora_dir / f"asyncrl-v{version}" / WEIGHTS)
        for _ in range(3):
            out = await worker.generate_one(GenerateRequest([3, 4], {"max_new_tokens": 2}))
        assert out.token_versions() == [version] * 2 and out.output_logprobs == [want] * 2

    try:
        fleet.start(learner)
        urls = [h.url for h in fleet.handles]
        argv = state(urls[0])["argv"]
        assert argv[argv.index("--enable-lora") :][:5] == [
            "--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "all"
        ]  # fmt: skip
        adapter_bytes = sum(t.numel() * 4 for _, t in learner.adapter_for_sync())
        assert fleet.last_sync["sync/bytes"] == adapter_bytes
        (router,) = fleet.urls_for_worker(0)
        worker = runner.run(_make_client(router))
        runner.run(generate(worker, 0))
        _train_a_step(learner)  # version 1
        fleet.sync(learner)
        runner.run(generate(worker, 1))
        _train_a_step(learner)  # version 2: refused by the engines
        with pytest.raises(WeightSyncError) as err:
            fleet.sync(learner)
        assert "\n" not in str(err.value) and "no free LoRA memory slot" in str(err.value)
        runner.run(generate(worker, 1))  # still served, still v1
        _train_a_step(learner)  # version 3
        fleet.sync(learner)
        runner.run(generate(worker, 3))
        runner.run(fleet.native.drain())
        for url in urls:
            assert list(state(url)["adapters"]) == ["asyncrl-v3"]
            assert state(url)["violations"] == []
        runner.run(worker.close())
    finally:
        fleet.stop()
        runner.close()


async def _make_client(url: str) -> EngineClient:
    return EngineClient(url, lora=True)  # its aiohttp session belongs to the runner's loop


@pytest.mark.skipif(
    not _fleet_wired(), reason="EngineFleet(lora=...) not wired yet: see issue 17's notes"
)
def test_a_run_trains_with_native_lora_syncs(tmp_path, tiny_model):
    """The real loop (`asyncrl.run.run`: Ray rollout workers, ZMQ, the LoRA learner) on an
    attached fake SGLang launched with asyncrl's LoRA flags: every sync loads the next adapter,
    every rollout request names one, the trained groups' versions stay within the bound and a
    sync moves the adapter's bytes only."""
    import json

    from asyncrl.run import run
    from tests.test_capability_matrix import BASE

    handle = start_lora_fake(tmp_path, "0.5.23", rank=8)
    overrides = [
        *BASE, f"actor_train.model_args.model_name_or_path={tiny_model}",
        f"output_dir={tmp_path / 'run'}", "actor_train.model_args.lora_rank=4",
        "weight_sync.lora_sync=native", "actor_infer.strategy_args.strategy_name=sglang",
        f"actor_infer.strategy_args.strategy_config={{server_urls: [{handle.url}]}}",
    ]  # fmt: skip
    try:
        run(load_config(None, overrides))
        rows = [
            json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n") if x
        ]
        rows = [r for r in rows if r.get("version") is not None]
        assert [r["version"] for r in rows] == [1, 2]
        calls = state(handle.url)["calls"]
        loads = [b["lora_name"] for p, b in calls if p == "/load_lora_adapter"]
        assert loads == ["asyncrl-v0", "asyncrl-v1", "asyncrl-v2"]
        named = [b.get("lora_path") for p, b in calls if p == "/generate" and b["input_ids"] != [0]]
        assert named and None not in named  # every rollout request named its adapter
        assert all(r["replay/staleness_max"] <= 1 for r in rows)
        learner = _learner(tiny_model)
        adapter_bytes = sum(t.numel() * 4 for _, t in learner.adapter_for_sync())
        assert all(r["sync/bytes"] == adapter_bytes for r in rows)
        assert state(handle.url)["violations"] == []
    finally:
        handle.stop()

"""SGLang's native LoRA path (`weight_sync.lora_sync: native`): the PEFT adapter each sync
writes, the launch flags, and the real sync and client driving fake SGLang processes
(tests/fake_sglang: `--enable-lora`, load/unload with SGLang's refusals, `lora_path` on
/generate, the adapter's file deciding the logprobs)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.config.validate import validate
from asyncrl.engine import sglang as sl
from asyncrl.engine.client import EngineClient, EngineError, GenerateRequest
from asyncrl.learner.logprobs import token_logprobs
from asyncrl.weights.lora_native import NativeLoraSync, write_adapter
from asyncrl.weights.sync import WeightSyncError
from tests.fake_sglang.fake_lora import BASE_LOGPROB, adapter_logprob
from tests.test_lora_learner import _batch, _learner, _train_a_step
from tests.test_sglang_backend import fake_env, infer_cfg, state

WEIGHTS = "adapter_model.safetensors"


def _launcher(tmp_path: Path, rank: int = 4, engines: int = 2, **config) -> sl.SGLangLauncher:
    from asyncrl.device import SPECS

    devices = "[" + ",".join(map(str, range(engines))) + "]"
    cfg = infer_cfg(tmp_path, tp=1, devices=devices, **fake_env(**config))
    lora = sl.LoraServing(rank, "all-linear")
    return sl.SGLangLauncher(
        cfg.actor_infer, tmp_path, tmp_path / "logs", 0, SPECS["cpu"], lora=lora
    )


def start_lora_fake(tmp_path: Path, version: str, rank: int = 8):
    """One fake SGLang `version` launched with `--enable-lora` (max rank `rank`, targets all)."""
    from tests.test_sglang_versions import start_fake

    return start_fake(tmp_path, version, 0.0, lora=sl.LoraServing(rank, "all-linear"))


def _tensors(rank: int = 4, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(2):
        for module in ("self_attn.q_proj", "self_attn.v_proj"):
            name = f"model.layers.{layer}.{module}"
            out.append((f"{name}.lora_A.weight", torch.randn(rank, 16, generator=g)))
            out.append((f"{name}.lora_B.weight", torch.randn(16, rank, generator=g)))
    return out


def _calls(url: str, path: str) -> list[dict]:
    return [body for p, body in state(url)["calls"] if p == path]


# ---- the adapter on disk -----------------------------------------------------------------------
@pytest.mark.parametrize("rslora", [False, True])
def test_written_adapter_is_the_learners_policy(tiny_model, tmp_path, rslora):
    """What SGLang loads is a PEFT adapter that *is* the learner's policy: loaded by peft onto
    the base model it gives the learner's logprobs (1e-5), rsLoRA scaling included."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    learner = _learner(tiny_model, f"actor_train.model_args.use_rslora={str(rslora).lower()}")
    _train_a_step(learner)  # B != 0: the adapter changes the policy
    written = write_adapter(learner.adapter_for_sync(), tmp_path / "asyncrl-v1")
    assert sorted(p.name for p in written.path.iterdir()) == ["adapter_config.json", WEIGHTS]
    assert written.rank == 4 and not list(tmp_path.glob(".asyncrl-v1.tmp*"))
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    served = PeftModel.from_pretrained(base, str(written.path)).eval()
    assert served.peft_config["default"].lora_alpha == served.peft_config["default"].r == 4
    data = _batch(learner)
    learner.model.eval()
    with torch.no_grad():
        want = token_logprobs(learner.model, data, 0.7)[0] * data["response_mask"]
        got = token_logprobs(served, data, 0.7)[0] * data["response_mask"]
        with served.disable_adapter():  # peft wrapped `base` in place
            plain = token_logprobs(served, data, 0.7)[0] * data["response_mask"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not torch.allclose(plain, want, atol=1e-3)  # the check is live


def test_adapter_write_refuses_what_is_not_an_adapter(tmp_path):
    with pytest.raises(WeightSyncError, match="not a LoRA adapter tensor"):
        write_adapter([("model.embed_tokens.weight", torch.ones(2, 2))], tmp_path / "a")
    mixed = _tensors(rank=4)[:2] + _tensors(rank=8)[2:4]
    with pytest.raises(WeightSyncError, match=r"disagree on the LoRA rank: \[4, 8\]"):
        write_adapter(mixed, tmp_path / "a")
    with pytest.raises(WeightSyncError, match="no adapter tensors"):
        write_adapter([], tmp_path / "a")


# ---- launch flags and validation ---------------------------------------------------------------
def test_lora_launch_flags():
    settings = sl.SGLangSettings.parse({"mem_fraction_static": 0.5})
    cmd = sl.server_command("/m", 1, 1, sl.with_lora(settings, sl.LoraServing(8, "all-linear")))
    tail = cmd[cmd.index("--mem-fraction-static") :]
    assert tail == ["--mem-fraction-static", "0.5", "--enable-lora", "--max-lora-rank", "8",
                    "--lora-target-modules", "all"]  # fmt: skip
    mine = sl.SGLangSettings.parse({"max_lora_rank": 64})  # strategy_config wins
    listed = sl.with_lora(mine, sl.LoraServing(8, ["q_proj", "v_proj"])).server_flags
    assert listed["max_lora_rank"] == 64 and listed["lora_target_modules"] == ["q_proj", "v_proj"]
    attached = sl.SGLangSettings.parse({"server_urls": ["http://h:1"]})
    assert sl.with_lora(attached, sl.LoraServing(8, "all-linear")) == attached
    assert sl.with_lora(settings, None) == settings


NATIVE = ["actor_train.model_args.lora_rank=8", "weight_sync.lora_sync=native"]
SGLANG = "actor_infer.strategy_args.strategy_name=sglang"
MULTINODE = ["cluster.address=auto", "cluster.bind_host=0.0.0.0", "rollout.transport_host=0.0.0.0"]


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ([], "native is SGLang's LoRA path; hf_infer engines take adapter"),
        ([SGLANG, *MULTINODE], "weight_sync.lora_dir"),
        ([SGLANG, "actor_train.model_args.lora_target_exclude=[o_proj]"], "lora_target_exclude"),
        ([SGLANG, "actor_train.model_args.target_modules=[lm_head]"], "'lm_head'"),
        ([SGLANG, "actor_train.model_args.target_modules=[k_proj]"], "q_proj and v_proj"),
        ([SGLANG, "actor_train.model_args.target_modules=[up_proj]"], "gate_proj and up_proj"),
    ],
)
def test_native_refusals_are_one_line(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment) as err:
        validate(load_config(None, [*NATIVE, *overrides]))
    assert "\n" not in str(err.value)


def test_native_configs_that_validate():
    validate(load_config(None, [*NATIVE, SGLANG]))
    validate(load_config(None, [*NATIVE, SGLANG, *MULTINODE, "weight_sync.lora_dir=/nfs/a"]))
    targets = "actor_train.model_args.target_modules=[q_proj,k_proj,v_proj,o_proj]"
    validate(load_config(None, [*NATIVE, SGLANG, targets]))


# ---- the sync and the client against fake SGLang engines ---------------------------------------
@pytest.mark.timing
def test_each_sync_loads_the_next_adapter_and_generates_name_it(tmp_path):
    """Two engines behind the router: each sync writes asyncrl-v{N}, every engine loads it, then
    reports N; requests name it and run on its weights; the previous one is unloaded everywhere
    and its directory removed."""
    launcher = _launcher(tmp_path, router_policy="round_robin")
    handles = [launcher.launch(i) for i in range(2)]
    urls = [h.url for h in handles]
    sync = NativeLoraSync(tmp_path / "lora", timeout_s=30)

    async def go() -> None:
        engines = [EngineClient(u) for u in urls]
        (router,) = launcher.actor_urls(urls)
        worker = EngineClient(router, lora=True)
        want: dict[int, float] = {}  # version -> the logprob its adapter file gives
        for version in range(3):
            stats = await sync.sync(engines, _tensors(seed=version), version, "in_place")
            assert stats.bytes == sum(t.numel() * 4 for _, t in _tensors()) and stats.tensors == 8
            want[version] = adapter_logprob(tmp_path / "lora" / f"asyncrl-v{version}" / WEIGHTS)
            ran = []
            for _ in range(3):  # round robin: both engines
                out = await worker.generate_one(GenerateRequest([3, 4], {"max_new_tokens": 3}))
                (v,) = set(out.token_versions())  # one adapter per request, honestly stamped
                assert out.weight_version == str(v) and out.output_logprobs == [want[v]] * 3
                ran.append(v)
            # sent before this client saw a reply of the new version: still the previous one
            assert ran[0] in (version - 1, version) and ran[1:] == [version, version]
            await sync.drain()
            for url in urls:
                assert list(state(url)["adapters"]) == [f"asyncrl-v{version}"]
                assert state(url)["version"] == str(version)
            assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == [f"asyncrl-v{version}"]
        for client in [*engines, worker]:
            await client.close()

    try:
        asyncio.run(go())
        argv = state(urls[0])["argv"]
        assert argv[argv.index("--enable-lora") :][:5] == [
            "--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "all"
        ]  # fmt: skip
        for url in urls:
            loads = _calls(url, "/load_lora_adapter")
            assert [b["lora_name"] for b in loads] == ["asyncrl-v0", "asyncrl-v1", "asyncrl-v2"]
            assert [b["lora_name"] for b in _calls(url, "/unload_lora_adapter")] == [
                "asyncrl-v0", "asyncrl-v1"
            ]  # fmt: skip
            assert state(url)["violations"] == []
        bodies = [b for url in urls for b in _calls(url, "/generate")]
        assert {b.get("lora_path") for b in bodies} == {
            None,
            "asyncrl-v0",
            "asyncrl-v1",
            "asyncrl-v2",
        }  # fmt: skip (None: a version probe)
        # without an adapter only 1-token version probes (the first, and after each refusal)
        assert {str(b["input_ids"]) for b in bodies if "lora_path" not in b} == {"[0]"}
    finally:
        launcher.close()
        for h in handles:
            h.stop()


@pytest.mark.timing
def test_a_request_in_flight_finishes_on_its_adapter_and_is_stamped_with_it(tmp_path):
    """A request started on v1 runs on v1's weights to the end and its tokens say v1, though
    the engine reports v2 by then; v1 is unloaded only after it finished; the next request
    names v2. pause_mode abort instead cuts it short (continued under v2 by the worker)."""
    launcher = _launcher(
        tmp_path, engines=1, env={**fake_env()["env"], "FAKE_SGLANG_TOKEN_DELAY_S": "0.05"}
    )
    handle = launcher.launch(0)
    sync = NativeLoraSync(tmp_path / "lora", timeout_s=30)
    v1_weights = tmp_path / "lora" / "asyncrl-v1" / WEIGHTS

    async def go() -> None:
        engine, worker = EngineClient(handle.url), EngineClient(handle.url, lora=True)
        await sync.sync([engine], _tensors(seed=1), 1)
        v1 = adapter_logprob(v1_weights)
        await worker.generate_one(GenerateRequest([3], {"max_new_tokens": 1}))  # its probe: done
        long = asyncio.create_task(
            worker.generate_one(GenerateRequest([3], {"max_new_tokens": 40}))
        )
        from tests.test_sglang_versions import until_in_flight

        await until_in_flight(handle.url, long)
        await sync.sync([engine], _tensors(seed=2), 2)  # no pause: nothing to hold
        assert state(handle.url)["version"] == "2"
        # v1's files are gone (an engine reads them once, at load), it still serves `long`
        assert not long.done() and not (tmp_path / "lora" / "asyncrl-v1").exists()
        assert not sync._unloads[0].done()  # SGLang frees v1 once `long` is done with it
        out = await long
        assert out.finish_reason == "length" and out.token_versions() == [1] * 40
        assert out.output_logprobs == [pytest.approx(v1)] * 40
        await sync.drain()  # v1's unload waited for it
        assert list(state(handle.url)["adapters"]) == ["asyncrl-v2"]
        nxt = await worker.generate_one(GenerateRequest([3], {"max_new_tokens": 2}))
        assert nxt.token_versions() == [2, 2]
        long = asyncio.create_task(
            worker.generate_one(GenerateRequest([3], {"max_new_tokens": 40}))
        )
        await until_in_flight(handle.url, long)
        await sync.sync([engine], _tensors(seed=3), 3, "abort")
        out = await long
        assert out.finish_reason == "abort" and set(out.token_versions()) <= {2}
        await sync.drain()
        for client in (engine, worker):
            await client.close()

    try:
        asyncio.run(go())
        assert state(handle.url)["violations"] == []
    finally:
        handle.stop()


@pytest.mark.timing
def test_a_refused_load_fails_the_sync_in_one_line_and_keeps_the_engine(tmp_path):
    """An adapter above --max-lora-rank is refused: the sync fails naming the engine, no engine
    switches (each keeps serving v0), and the next sync that fits works; a client naming an
    adapter unloaded meanwhile is retried once on the current one."""
    launcher = _launcher(tmp_path, rank=4, router=False)
    handles = [launcher.launch(i) for i in range(2)]
    urls = [h.url for h in handles]
    sync = NativeLoraSync(tmp_path / "lora", timeout_s=30)

    async def go() -> None:
        engines = [EngineClient(u) for u in urls]
        worker = EngineClient(urls[1], lora=True)
        await sync.sync(engines, _tensors(seed=0), 0)
        assert (await worker.generate_one(GenerateRequest([3], {"max_new_tokens": 1}))).version == 0
        with pytest.raises(WeightSyncError) as err:
            await sync.sync(engines, _tensors(rank=8, seed=1), 1)
        message = str(err.value)
        assert "\n" not in message and "LoRA load failed on engine http://" in message
        assert "rank 8 is incompatible" in message
        for url in urls:
            assert state(url)["version"] == "0" and "asyncrl-v0" in state(url)["adapters"]
        out = await worker.generate_one(GenerateRequest([3], {"max_new_tokens": 1}))
        assert out.token_versions() == [0]
        await sync.sync(engines, _tensors(seed=2), 2)
        await sync.drain()
        for url in urls:
            assert list(state(url)["adapters"]) == ["asyncrl-v2"]
        # the worker still names v0 (it saw no v2 reply yet): refused, re-read, retried on v2
        out = await worker.generate_one(GenerateRequest([3], {"max_new_tokens": 1}))
        assert out.token_versions() == [2]
        last = [b.get("lora_path") for b in _calls(urls[1], "/generate")][-3:]
        assert last == ["asyncrl-v0", None, "asyncrl-v2"]  # refused, the version probe, retried
        for client in [*engines, worker]:
            await client.close()

    try:
        asyncio.run(go())
    finally:
        for h in handles:
            h.stop()


def test_engine_without_lora_refuses_in_one_line_and_never_serves_the_bare_base(tmp_path):
    """A server started without --enable-lora: the sync names the flag. A LoRA client facing an
    engine without asyncrl's adapter (not started so, or relaunched and not synced yet) fails
    its request, naming why, instead of sampling the bare base model under an adapter's
    version; a client made without `lora` never names one."""
    from tests.test_sglang_versions import start_fake

    plain, bare = start_fake(tmp_path, "0.5.23", delay=0.0), start_lora_fake(tmp_path, "0.5.23")
    sync = NativeLoraSync(tmp_path / "lora", timeout_s=30)
    req = GenerateRequest([3], {"max_new_tokens": 2})

    async def go() -> None:
        async with EngineClient(plain.url) as engine:
            with pytest.raises(WeightSyncError, match="Please set `--enable-lora`"):
                await sync.sync([engine], _tensors(), 0)
        for handle, why in ((plain, "LoRA is not enabled"), (bare, "never been loaded")):
            async with EngineClient(handle.url, lora=True) as worker:
                with pytest.raises(EngineError, match=why):
                    await worker.generate_one(req)
            async with EngineClient(handle.url) as base:  # lora=False: the base model
                assert (await base.generate_one(req)).output_logprobs == [BASE_LOGPROB] * 2
            bodies = _calls(handle.url, "/generate")
            assert "lora_path" not in bodies[-1] and bodies[-1]["input_ids"] == [3]
            # before it, only 1-token version probes went without an adapter
            probes = [b for b in bodies[:-1] if "lora_path" not in b]
            assert probes and all(b["input_ids"] == [0] for b in probes)

    try:
        asyncio.run(go())
    finally:
        plain.stop()
        bare.stop()

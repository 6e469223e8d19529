"""Every request body asyncrl sends, checked against SGLang's own code from its wheels.

The wheels of the lowest and highest supported SGLang (`asyncrl.engine.versions`) are fetched
once with `pip download --no-deps` into `ASYNCRL_WHEEL_CACHE` (default
~/.cache/asyncrl/wheels); a test skips, saying why, when a wheel cannot be had. The bodies are
the real ones: the real EngineClient and WeightSender drive the fake server (which records
them) through generation, a sync in every pause mode and the group's set-up and teardown. Each
body is then checked against the request struct read with `ast` from the wheel's
`srt/managers/io_struct.py` (an unknown field is one SGLang would drop or refuse; a value must
fit the field's annotation), and every `sampling_params` through SGLang's own
`SamplingParams.__post_init__`/`verify` (and, on 0.5.23, its `/generate` JSON contract gate).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from asyncrl.config.schema import GeneratingArgs
from asyncrl.engine.client import EngineClient
from asyncrl.engine.versions import MAX_VERSION, MIN_VERSION
from asyncrl.rollout.settings import sampling_params
from asyncrl.weights.sync import WeightSender
from tests.fake_sglang.wheel_structs import load_module, read_structs, violations
from tests.test_sglang_versions import start_fake, state

VERSIONS = [".".join(map(str, v)) for v in (MIN_VERSION, MAX_VERSION)]
CACHE = Path(os.environ.get("ASYNCRL_WHEEL_CACHE", Path.home() / ".cache/asyncrl/wheels"))
#: The request struct behind each endpoint asyncrl calls (SGLang's http_server.py).
STRUCTS = {
    "/generate": "GenerateReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
}


def wheel(version: str) -> zipfile.ZipFile:
    """SGLang's wheel of `version`, from the cache or PyPI; skip (with the reason) if neither."""
    found = sorted(CACHE.glob(f"sglang-{version}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"sglang=={version}"]
        try:
            done = subprocess.run(
                [*cmd, "-d", str(CACHE)], capture_output=True, text=True, timeout=600
            )
        except subprocess.TimeoutExpired:
            pytest.skip(f"pip download sglang=={version} took over 600 s")
        found = sorted(CACHE.glob(f"sglang-{version}-*.whl"))
        if not found:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            pytest.skip(f"cannot download the sglang {version} wheel: {tail[0]}")
    return zipfile.ZipFile(found[-1])


def bodies_sent(tmp_path: Path, version: str) -> list[tuple[str, dict]]:
    """Every (path, body) the real client and sender send to an engine of `version`."""
    handle = start_fake(tmp_path, version, delay=0.0)
    gen = GeneratingArgs(temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=[2])

    async def go() -> None:
        async with EngineClient(handle.url) as client:
            sender = WeightSender(group_name="contract", timeout_s=30)
            await sender.init_group([client], backend="gloo")
            for params in (
                sampling_params(gen, 8, seed=123),
                sampling_params(gen, 8, greedy=True),
                sampling_params(GeneratingArgs(), 8),
            ):
                await client.generate_one({"input_ids": [3, 4], "sampling_params": params})
            await client.generate(  # a group in SGLang's batch form (single-turn rollouts)
                [
                    {"input_ids": [3, 4], "sampling_params": sampling_params(gen, 8, seed=1)},
                    {"input_ids": [3, 4, 5], "sampling_params": params, "rid": "g-1"},
                ]
            )
            named = [("a", torch.ones(3)), ("b", torch.ones(2, dtype=torch.bfloat16))]
            for i, mode in enumerate(("in_place", "retract", "abort", None)):
                fmt = "flattened_bucket" if i % 2 else None
                await sender.sync(named, i + 1, bucket_bytes=8, load_format=fmt, pause_mode=mode)
            await sender.close()

    try:
        asyncio.run(go())
        return [(p, b) for p, b in state(handle.url)["calls"]] + lora_bodies_sent(tmp_path, version)
    finally:
        handle.stop()


def lora_bodies_sent(tmp_path: Path, version: str) -> list[tuple[str, dict]]:
    """The native LoRA path's bodies (`lora_sync: native`): the real NativeLoraSync over two
    versions (load, version switch, unload) and a /generate naming the adapter (`lora_path`),
    against a fake launched with asyncrl's `--enable-lora` flags."""
    from asyncrl.weights.lora_native import NativeLoraSync
    from tests.test_lora_native import _tensors, start_lora_fake

    handle = start_lora_fake(tmp_path, version)
    sync = NativeLoraSync(tmp_path / "lora", timeout_s=30)

    async def go() -> None:
        async with EngineClient(handle.url) as engine:
            for v in (1, 2):
                await sync.sync([engine], _tensors(seed=v), v, "abort")
                await sync.drain()
                async with EngineClient(
                    handle.url, lora=True
                ) as worker:  # finds asyncrl-v{v} served
                    await worker.generate_one({"input_ids": [3, 4], "sampling_params": {}})

    try:
        asyncio.run(go())
        calls = [(p, b) for p, b in state(handle.url)["calls"]]
        named = [b.get("lora_path") for p, b in calls if p == "/generate"]
        assert named == [None, "asyncrl-v1", None, "asyncrl-v2"]  # each after a version probe
        assert {"/load_lora_adapter", "/unload_lora_adapter", "/update_weight_version"} <= {
            p for p, _ in calls
        }
        return calls
    finally:
        handle.stop()


@pytest.mark.parametrize("version", VERSIONS)
def test_every_body_fits_sglangs_request_structs(tmp_path, version):
    whl = wheel(version)
    structs = read_structs(whl.read("sglang/srt/managers/io_struct.py").decode())
    calls = bodies_sent(tmp_path, version)
    sent = {p for p, _ in calls}
    assert {"/generate", "/update_weights_from_distributed", "/pause_generation"} <= sent
    problems = []
    for path, body in calls:
        if path == "/flush_cache":  # SGLang reads no body there (a `timeout` query at most)
            assert body == {}
            continue
        assert path in STRUCTS, f"asyncrl calls {path}, which this test does not know"
        struct = structs.get(STRUCTS[path])
        if struct is None:
            problems.append(f"{path}: SGLang {version} has no {STRUCTS[path]}")
            continue
        problems += [f"{path}: {p}" for p in violations(struct, body)]
    assert problems == [], "\n".join(problems)
    # the check is live: a field SGLang would drop, a mistyped and a missing one are caught
    assert violations(structs[STRUCTS["/update_weight_version"]], {"version": "1"}) == [
        "UpdateWeightVersionReqInput has no field 'version'",
        "UpdateWeightVersionReqInput requires 'new_version'",
    ]
    assert violations(structs[STRUCTS["/pause_generation"]], {"mode": "drain"})


@pytest.mark.parametrize("version", VERSIONS)
def test_every_sampling_params_passes_sglangs_own_checks(tmp_path, version):
    """SGLang's SamplingParams (post-init + verify) accept what asyncrl sends, and on 0.5.23 its
    `/generate` contract gate accepts the whole body."""
    whl = wheel(version)
    sp = load_module(whl, "sglang/srt/sampling/sampling_params.py")
    gate = None
    if "sglang/api/v1/api_types.py" in whl.namelist():
        gate = load_module(whl, "sglang/api/v1/api_types.py")
    generates = [b for p, b in bodies_sent(tmp_path, version) if p == "/generate"]
    assert len(generates) == 8 and [b.get("lora_path") for b in generates[4:]] == [
        None,
        "asyncrl-v1",
        None,
        "asyncrl-v2",
    ]  # fmt: skip (the LoRA client's version probes, then its requests)
    assert isinstance(generates[3]["input_ids"][0], list)  # the batch
    for body in generates:
        batch = body["sampling_params"]
        for one in batch if isinstance(batch, list) else [batch]:
            sp.SamplingParams(**one).verify(vocab_size=64)
        if gate is not None:
            gate.GenerateRequest.from_json_value(body)
    bad = {**generates[0]["sampling_params"], "top_p": 0.0}  # the check is live
    with pytest.raises(ValueError, match="top_p"):
        sp.SamplingParams(**bad).verify(vocab_size=64)
    if gate is not None:
        with pytest.raises(gate.JsonContractError):
            gate.GenerateRequest.from_json_value({**generates[0], "return_logprob": "yes"})

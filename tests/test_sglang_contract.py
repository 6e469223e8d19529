"""Every request and launch line asyncrl sends, run through SGLang's own code from its wheels.

For each release in `asyncrl.engine.versions.CONTRACT_VERSIONS` (the supported range is exactly
theirs) the wheel is fetched once with `pip download --no-deps` into `ASYNCRL_WHEEL_CACHE`; a
wheel that cannot be had fails the test (`ASYNCRL_SKIP_UPSTREAM=1` skips, offline). The bodies
are the real ones: the real EngineClient and WeightSender drive the fake server (which records
them) through generation, a sync in every pause mode and the group's set-up and teardown, and
the native LoRA path. Then, in one subprocess per release (tests/fake_sglang/upstream_exec.py),
SGLang's own code runs on them: each /generate body becomes its `GenerateReqInput`, normalized
and split per request (`obj[i]`) as the tokenizer manager does, each request's sampling
parameters go through `SamplingParams` (`normalize`, `verify`) and its `extra_key` into a
radix-cache key; every other body builds its endpoint's request struct (`Struct(**body)`, its
post-init checks included); every launch line `server_command` makes goes through SGLang's
`ServerArgs.add_cli_args` parser and `from_cli_args`. The router's line goes through the
installed sglang-router's own `parse_router_args`.
"""

from __future__ import annotations

import asyncio
import re
import tomllib
from pathlib import Path

import pytest
import torch
import yaml

from asyncrl.config.schema import GeneratingArgs
from asyncrl.engine.client import EngineClient
from asyncrl.engine.sglang import (
    PRIORITY_DEFAULT_VERSION,
    LoraServing,
    SGLangConfigError,
    SGLangSettings,
    router_command,
    server_command,
    with_lora,
    with_priority,
)
from asyncrl.engine.versions import CONTRACT_VERSIONS, MAX_VERSION, MIN_VERSION, parse_version
from asyncrl.rollout.settings import sampling_params
from asyncrl.weights.sync import WeightSender
from tests.fake_sglang.wheels import run_upstream, wheel
from tests.test_sglang_versions import start_fake, state

__all__ = ["wheel"]  # tests/test_priority.py reads the wheels through here
VERSIONS = list(CONTRACT_VERSIONS)
REPO = Path(__file__).resolve().parents[1]
#: The request struct behind each endpoint asyncrl calls (SGLang's http_server.py).
STRUCTS = {
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
#: Known-bad inputs, each refused by every release: the checks are live.
BAD_STRUCT = ("PauseGenerationReqInput", {"mod": "abort"})  # no such field
BAD_GENERATE = {"input_ids": [3, 4], "sampling_params": {"top_p": 0.0}}
BAD_LAUNCH = ["--model-path", "/m", "--no-such-flag"]


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


def shipped_strategy_configs() -> dict[str, tuple[dict, str | None]]:
    """Each shipped config's sglang `strategy_config` and dtype (configs/*.yaml)."""
    out = {}
    for path in sorted((REPO / "configs").glob("*.yaml")):
        infer = (yaml.safe_load(path.read_text()) or {}).get("actor_infer") or {}
        strategy = infer.get("strategy_args") or {}
        if strategy.get("strategy_name") == "sglang":
            dtype = (infer.get("model_args") or {}).get("dtype")
            out[path.name] = (strategy.get("strategy_config") or {}, dtype)
    return out


def launch_lines(version: str) -> dict[str, list[str] | None]:
    """Every kind of `server_command` line asyncrl launches SGLang `version` with (None: asyncrl
    refuses that setting for `version` up front, with SGLangConfigError)."""
    base = SGLangSettings.parse({}, "bf16")
    cases = {
        "plain": base,
        "deterministic": SGLangSettings.parse({"enable_deterministic_inference": True}, "fp16"),
        "lora all-linear": with_lora(base, LoraServing(8, "all-linear")),
        "lora modules": with_lora(base, LoraServing(16, ["q_proj", "v_proj"])),
        "lof, context length": SGLangSettings.parse(
            {"schedule_policy": "lof", "max_model_len": 2048}
        ),
    }
    for name, (config, dtype) in shipped_strategy_configs().items():
        cases[name] = SGLangSettings.parse(config, dtype)
    lines: dict[str, list[str] | None] = {}
    for name, case in cases.items():
        for eval_priority in (None, -1):  # logging.eval_priority: off, and the default
            key = name if eval_priority is None else f"{name} + eval_priority=-1"
            try:
                settings = with_priority(case, eval_priority, version)
            except SGLangConfigError:
                lines[key] = None
                continue
            cmd = server_command("/models/m", 30001, 2, settings, seed=7, api_key="k")
            lines[key] = cmd[cmd.index("sglang.launch_server") + 1 :]
    return lines


def request_for(version: str, tmp: Path) -> tuple[list, dict, dict]:
    """(bodies sent, launch lines, what SGLang `version`'s code is to run on them)."""
    calls = bodies_sent(tmp, version)
    lines = launch_lines(version)
    priority = ["--enable-priority-scheduling", "--default-priority-value", "0"]
    request = {
        "generate": [b for p, b in calls if p == "/generate"] + [BAD_GENERATE],
        "structs": [[STRUCTS[p], b] for p, b in calls if p in STRUCTS] + [list(BAD_STRUCT)],
        "server_args": [x for x in lines.values() if x is not None]
        + [BAD_LAUNCH, ["--model-path", "/m", *priority]],
    }
    return calls, lines, request


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict[str, tuple[list, dict, dict]]:
    """Per release: (bodies sent, launch lines, SGLang's own verdict), all releases run once."""
    built = {v: request_for(v, tmp_path_factory.mktemp(f"sglang-{v}")) for v in VERSIONS}
    ran = run_upstream({v: request for v, (_, _, request) in built.items()})
    for version, result in ran.items():
        assert "crash" not in result, f"SGLang {version}'s code did not run:\n{result['crash']}"
    return {v: (calls, lines, ran[v]) for v, (calls, lines, _) in built.items()}


@pytest.fixture
def sent(request, verdicts):
    return verdicts[request.node.callspec.params["version"]]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_generate_body_runs_through_sglangs_own_request(sent, version):
    """SGLang's GenerateReqInput normalizes each body and hands each request (a batch split
    with `obj[i]`) valid sampling parameters and a hashable `extra_key` (a str or None)."""
    calls, _, verdict = sent
    generates = [b for p, b in calls if p == "/generate"]
    assert len(generates) == 8 and isinstance(generates[3]["input_ids"][0], list)  # a batch
    assert [b.get("lora_path") for b in generates[4:]] == [None, "asyncrl-v1", None, "asyncrl-v2"]
    assert verdict["radix_error"] is None  # the radix cache's own RadixKey built every key
    *results, bad = verdict["generate"]
    problems = []
    for body, result in zip(generates, results, strict=True):
        if result["error"]:
            problems.append(f"{result['error']} on {body}")
            continue
        n = len(body["input_ids"]) if isinstance(body["input_ids"][0], list) else 1
        assert len(result["subs"]) == n  # one request per prompt
        problems += [
            f"{s['error']} (request {s['rid']} of {body})" for s in result["subs"] if s["error"]
        ]
    assert problems == [], f"SGLang {version} on asyncrl's /generate bodies:\n" + "\n".join(
        problems
    )
    assert "top_p" in bad["subs"][0]["error"]  # live: SGLang's own verify refuses top_p 0


@pytest.mark.parametrize("version", VERSIONS)
def test_every_other_body_builds_sglangs_request_struct(sent, version):
    calls, _, verdict = sent
    paths = {p for p, _ in calls}
    assert {"/generate", "/update_weights_from_distributed", "/pause_generation"} <= paths
    for path, body in calls:  # every endpoint asyncrl calls is one checked here
        assert path in STRUCTS or path == "/generate" or (path, body) == ("/flush_cache", {})
    *results, bad = verdict["structs"]
    checked = [(p, b) for p, b in calls if p in STRUCTS]
    problems = [f"{p} {b}: {r}" for (p, b), r in zip(checked, results, strict=True) if r]
    assert problems == [], f"SGLang {version} refuses:\n" + "\n".join(problems)
    assert (
        "unexpected keyword argument 'mod'" in bad.lower()
    )  # live: an unknown field is a TypeError


@pytest.mark.parametrize("version", VERSIONS)
def test_sglangs_server_parser_accepts_every_launch_line(sent, version):
    """SGLang's own ServerArgs parser takes every line asyncrl launches it with, and asyncrl
    refuses eval priority exactly where that parser has no `--default-priority-value`."""
    _, lines, verdict = sent
    *results, bad, priority = verdict["server_args"]
    launched = [k for k, v in lines.items() if v is not None]
    problems = [f"{k}: {r}" for k, r in zip(launched, results, strict=True) if r]
    assert problems == [], f"SGLang {version}'s ServerArgs refuses:\n" + "\n".join(problems)
    assert "--no-such-flag" in bad  # live
    has_priority_default = priority is None
    refused = sorted(k for k, v in lines.items() if v is None)
    if has_priority_default:
        assert refused == [], f"asyncrl refuses {refused} on SGLang {version}, which takes them"
    else:
        assert "--default-priority-value" in priority
        assert refused and all(k.endswith("eval_priority=-1") for k in refused)
    assert has_priority_default == (parse_version(version) >= PRIORITY_DEFAULT_VERSION)


def test_router_parser_accepts_router_command():
    """sglang-router's own argument parser (the installed package's) on `router_command`."""
    from sglang_router.launch_router import parse_router_args

    urls = ["http://127.0.0.1:30001", "http://127.0.0.1:30002"]
    for config in [{}, {"router_policy": "round_robin", "router_args": {"max_payload_size": 1}}]:
        settings = SGLangSettings.parse(config)
        for api_key in (None, "k"):
            cmd = router_command(urls, 30000, settings, api_key)
            args = parse_router_args(cmd[cmd.index("sglang_router.launch_router") + 1 :])
            assert args.worker_urls == urls and args.port == 30000
            assert args.policy == settings.router_policy and args.api_key == api_key
    with pytest.raises(SystemExit):  # live
        parse_router_args(["--worker-urls", urls[0], "--no-such-flag"])


def test_declared_range_is_the_executed_range():
    """pyproject's `sglang` extra and versions.py's MIN/MAX are the lowest and highest release
    the contract tests run."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["sglang"]
    spec = next(s for s in extra if s.startswith("sglang["))
    low, high = re.fullmatch(r"sglang\[srt\]>=([\d.]+),<([\d.]+)", spec).groups()
    executed = sorted(parse_version(v) for v in CONTRACT_VERSIONS)
    assert parse_version(low) == executed[0] == MIN_VERSION
    assert executed[-1] == MAX_VERSION
    *head, last = executed[-1]
    assert parse_version(high) == (*head, last + 1)  # `<` the next patch release

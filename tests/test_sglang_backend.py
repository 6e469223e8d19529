"""The sglang backend: config -> server and router command lines, and the real launcher,
EngineFleet, client and WeightSender driving fake SGLang processes (tests/fake_sglang: the same
CLI, endpoints and reply shapes, every request checked against SGLang's request structs)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.config.async_checks import pause_mode
from asyncrl.device import SPECS
from asyncrl.engine import sglang as sl
from asyncrl.engine import sglang_process as sp
from asyncrl.engine.client import EngineClient, GenerateRequest
from asyncrl.engine.process import EngineLaunchError
from asyncrl.net import free_port

FAKE = str(Path(__file__).parent / "fake_sglang")


def infer_cfg(tmp_path, tp=2, devices="[0,1,2,3]", **strategy_config):
    cfg = load_config(
        None,
        [
            "actor_infer.strategy_args.strategy_name=sglang",
            f"actor_infer.num_gpus_per_worker={tp}",
            f"actor_infer.device_mapping={devices}",
            "actor_infer.model_args.dtype=bf16",
            f"output_dir={tmp_path}",
        ],
    )
    cfg.actor_infer.strategy_args.strategy_config = dict(strategy_config)
    return cfg


def fake_env(**extra):
    path = os.pathsep.join([FAKE, os.environ.get("PYTHONPATH", "")])
    return {"env": {"PYTHONPATH": path}, "launch_timeout_s": 90, **extra}


def state(url: str) -> dict:
    with urllib.request.urlopen(url + "/_fake/state", timeout=10) as r:
        return json.loads(r.read())


# ---- command lines -----------------------------------------------------------------------------
def test_server_and_router_commands_from_config(tmp_path):
    cfg = infer_cfg(
        tmp_path,
        mem_fraction_static=0.7,
        load_format="dummy",
        max_model_len=4096,
        disable_radix_cache=True,
        enable_metrics=False,
        cuda_graph_bs=[1, 2, 4],
        json_model_override_args={"rope_theta": 1000000},
        router_policy="round_robin",
        router_args={"balance_abs_threshold": 8},
    )
    infer = cfg.actor_infer
    settings = sl.SGLangSettings.parse(infer.strategy_args.strategy_config, infer.model_args.dtype)
    cmd = sl.server_command("/models/qwen", 31000, infer.num_gpus_per_worker, settings, seed=5)
    assert cmd == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/qwen",
        "--host", "127.0.0.1", "--port", "31000", "--tp-size", "2",
        "--mem-fraction-static", "0.7", "--load-format", "dummy", "--context-length", "4096",
        "--disable-radix-cache", "--cuda-graph-bs", "1", "2", "4",
        "--json-model-override-args", '{"rope_theta": 1000000}',
        "--dtype", "bfloat16", "--random-seed", "5",
    ]  # fmt: skip
    router = sl.router_command(["http://a:1", "http://b:2"], 9000, settings)
    assert router[:-1] == [
        sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", "http://a:1",
        "http://b:2", "--policy", "round_robin", "--host", "127.0.0.1", "--port", "9000",
        "--disable-health-check", "--balance-abs-threshold", "8",  # see router_command
        "--prometheus-host", "127.0.0.1", "--prometheus-port",
    ]  # fmt: skip
    # the exporter: loopback and a free port (sglang-router's default 0.0.0.0:29000 clashes)
    assert router[-1].isdigit() and router[-1] != "29000"
    settings.router_args.update(prometheus_host="10.0.0.5", prometheus_port=9100)
    assert sl.router_command(["http://a:1"], 9000, settings)[-4:] == [
        "--prometheus-host", "10.0.0.5", "--prometheus-port", "9100",
    ]  # fmt: skip
    assert sl.engine_devices(infer.device_mapping, 2) == [[0, 1], [2, 3]]
    assert sl.engine_devices([], 2) == [[]]
    assert SPECS["cuda"].visibility([2, 3]) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert SPECS["npu"].visibility([2, 3]) == {"ASCEND_RT_VISIBLE_DEVICES": "2,3"}


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"tp_size": 2}, "tp_size is set by asyncrl"),
        ({"port": 1}, "port is set by asyncrl"),
        ({"server_urls": "http://x"}, "list of URLs"),
        ({"router": "yes"}, "true, false or auto"),
        ({"dp_size": 2}, "dp_size=2: SGLang's weight update from the learner needs dp_size 1"),
        ({"pipeline_parallel_size": 2}, "needs pp_size 1"),
    ],
)
def test_bad_strategy_config_is_one_clear_error(config, fragment):
    with pytest.raises(sl.SGLangConfigError, match=fragment):
        sl.SGLangSettings.parse(config)


def test_device_mapping_must_split_into_engines():
    with pytest.raises(sl.SGLangConfigError, match="not a multiple of num_gpus_per_worker=2"):
        sl.engine_devices([0, 1, 2], 2)


# ---- processes ---------------------------------------------------------------------------------
def test_launch_failure_reports_the_log_tail(tmp_path, tiny_model):
    cfg = infer_cfg(tmp_path, tp=1, devices="[]", not_a_flag=3, **fake_env())
    launcher = sl.SGLangLauncher(cfg.actor_infer, tiny_model, tmp_path, 0, SPECS["cpu"])
    with pytest.raises(EngineLaunchError, match="unrecognized arguments: --not-a-flag 3"):
        launcher.launch(0)


def test_each_engine_sees_only_its_devices(tmp_path, tiny_model):
    cfg = infer_cfg(tmp_path, load_format="dummy", **fake_env())
    launcher = sl.SGLangLauncher(cfg.actor_infer, tiny_model, tmp_path, 7, SPECS["cuda"])
    assert launcher.num_engines == 2 and launcher.tp_size == 2
    handle = launcher.launch(1)
    try:
        got = state(handle.url)
        assert got["visible"] == "2,3"
        argv = got["argv"]
        assert argv[argv.index("--tp-size") + 1] == "2"
        assert argv[argv.index("--random-seed") + 1] == "8"
        assert argv[argv.index("--load-format") + 1] == "dummy"
    finally:
        handle.stop()


def test_attach_to_given_servers_checks_tp_size(tmp_path, tiny_model):
    settings = sl.SGLangSettings.parse(fake_env())
    port = free_port()
    cmd = sl.server_command(tiny_model, port, 1, settings)
    url = f"http://127.0.0.1:{port}"
    handle = sp.start_process(cmd, settings.env, url, tmp_path / "attached.log")
    try:
        sp.wait_healthy(handle, "/health_generate", 90, "fake")
        ok = infer_cfg(tmp_path, tp=1, devices="[]", server_urls=[url + "/"])
        launcher = sl.SGLangLauncher(ok.actor_infer, tiny_model, tmp_path, 0, SPECS["cpu"])
        assert launcher.num_engines == 1
        assert launcher.launch(0).url == url and launcher.actor_urls([url]) == [url]
        bad = infer_cfg(tmp_path, tp=2, devices="[]", server_urls=[url])
        launcher = sl.SGLangLauncher(bad.actor_infer, tiny_model, tmp_path, 0, SPECS["cpu"])
        with pytest.raises(EngineLaunchError, match="tp_size=1.*num_gpus_per_worker=2"):
            launcher.launch(0)
    finally:
        handle.stop()


def digests(learner, dtype) -> dict[str, str]:
    out = {}
    for name, t in learner.weights_for_sync():
        t = t.detach().to(dtype if t.is_floating_point() else t.dtype).contiguous()
        out[name] = hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def check_engine(url: str, expected: dict[str, str], version: str, pause_mode: str) -> list:
    got = state(url)
    assert got["violations"] == []
    assert got["version"] == version
    for rank in got["received"]:  # every TP rank received every byte
        assert rank == expected
    calls = got["calls"]
    last_pause = max(i for i, (p, _) in enumerate(calls) if p == "/pause_generation")
    assert calls[-1][0] == "/continue_generation"  # the latest sync: pause ... continue
    updates = [b for p, b in calls[last_pause:] if p == "/update_weights_from_distributed"]
    assert all(b["weight_version"] is None for b in updates[:-1])
    # The version rides on the last bucket; no bucket flushes (a flush refused while paused
    # requests hold KV kills SGLang <= 0.5.22). 0.5.23 (the fake's default): the buckets sit
    # inside one weight-update session, closed before generation continues.
    assert updates[-1]["weight_version"] == version and not any(b["flush_cache"] for b in updates)
    paths = [p for p, _ in calls[last_pause:]]
    assert paths[1] == "/begin_weight_update" and paths[-2] == "/end_weight_update"
    assert paths.count("/begin_weight_update") == paths.count("/end_weight_update") == 1
    pauses = [b for p, b in got["calls"] if p == "/pause_generation"]
    assert pauses and all(b == {"mode": pause_mode} for b in pauses)
    return updates


def test_engine_set_launches_routes_syncs_and_heals(tmp_path, tiny_model, monkeypatch):
    """The real EngineFleet on strategy sglang: 2 engines x tp 2 behind the router, gloo group of
    world 5, flattened and per-tensor buckets, byte-exact on every rank, then a heal."""
    from asyncrl.engine.fleet import EngineFleet
    from asyncrl.learner.base import make_learner
    from asyncrl.net import AsyncRunner

    monkeypatch.setenv("ASYNCRL_DEVICE", "cpu")
    cfg = infer_cfg(tmp_path, load_format="dummy", router_policy="round_robin", **fake_env())
    cfg.weight_sync.bucket_size_mb = 0.02
    cfg.weight_sync.timeout_s = 60
    cfg.weight_sync.load_format = "flattened_bucket"  # auto would pick tensors on gloo
    learner = make_learner(
        "fsdp2_train", model_path=tiny_model, train=cfg.actor_train, actor=cfg.actor,
        algorithm=cfg.algorithm, temperature=1.0, total_steps=1, seed=0,
    )  # fmt: skip
    runner = AsyncRunner()
    engines = EngineFleet(
        cfg.actor_infer, cfg.weight_sync, pause_mode(cfg), tiny_model, Path(cfg.output_dir),
        seed=cfg.seed, request_timeout_s=cfg.rollout.request_timeout_s, runner=runner,
    )  # fmt: skip
    try:
        engines.start(learner)  # launch, group (world 1 + 2 + 2), first sync
        urls = [h.url for h in engines.handles]
        expected = digests(learner, torch.bfloat16)
        for url in urls:
            updates = check_engine(url, expected, "0", pause_mode(cfg))
            assert len(updates) > 1 and all(b["load_format"] == "flattened_bucket" for b in updates)
            assert all(len({str(d) for d in b["dtypes"]}) == 1 for b in updates)
        assert engines.last_sync["sync/gb_per_s"] > 0 and engines.last_sync["sync/buckets"] > 1

        (router,) = engines.urls_for_worker(0)
        argv = state(router)["argv"]
        assert router not in urls and argv[argv.index("--port") + 1] == router.rsplit(":", 1)[1]
        assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"

        async def generate():
            async with EngineClient(router) as client:
                req = GenerateRequest([3, 4], {"max_new_tokens": 4, "stop_token_ids": [1]})
                return [await client.generate_one(req) for _ in range(2)]

        outs = runner.run(generate())
        assert [len(o.output_logprobs) for o in outs] == [len(o.output_ids) for o in outs]
        assert {o.weight_version for o in outs} == {"0"}

        engines.ws.load_format = "tensors"
        learner.version = 3
        engines.sync(learner)
        for url in urls:
            assert check_engine(url, expected, "3", pause_mode(cfg))[-1]["load_format"] is None

        engines.handles[1].proc.kill()
        engines.handles[1].proc.wait()
        assert engines.heal(learner)  # same port, group re-formed, weights pushed again
        assert engines.handles[1].url == urls[1]
        check_engine(urls[1], expected, "3", pause_mode(cfg))
    finally:
        engines.stop()
        runner.close()


def test_fake_flags_protocol_violations(tmp_path, tiny_model):
    """The fake's checks are live: a body SGLang would refuse is refused and recorded."""
    settings = sl.SGLangSettings.parse(fake_env())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    handle = sp.start_process(
        sl.server_command(tiny_model, port, 1, settings), settings.env, url, tmp_path / "f.log"
    )
    try:
        sp.wait_healthy(handle, "/health_generate", 90, "fake")

        async def bad_calls():
            async with EngineClient(url) as client:
                body = {"names": ["w"], "dtypes": ["torch.float32"], "shapes": [[1]], "x": 1}
                return await client.http.call("POST", "/update_weights_from_distributed", body)

        status, _ = asyncio.run(bad_calls())
        assert status == 400
        problems = state(url)["violations"]
        assert any("unknown field 'x'" in p for p in problems)
        assert any("'torch.float32' is not a bare torch dtype" in p for p in problems)
    finally:
        handle.stop()


def test_api_key_reaches_servers_router_and_clients(tmp_path, tiny_model):
    """With a key: each server gets `--api-key` (SGLang reads it from argv only), so does the
    router (its key for calling workers); a client without it gets 401, /health* stays open."""
    key = "sglang-test-key"
    cfg = infer_cfg(tmp_path, tp=1, devices="[0,1]", load_format="dummy", **fake_env())
    launcher = sl.SGLangLauncher(cfg.actor_infer, tiny_model, tmp_path, 0, SPECS["cpu"], key)
    handles = [launcher.launch(i) for i in range(2)]
    try:
        argv = state(handles[0].url)["argv"]
        assert argv[-2:] == ["--api-key", key]
        (router,) = launcher.actor_urls([h.url for h in handles])
        assert state(router)["argv"][-2:] == ["--api-key", key]

        async def go():
            req = GenerateRequest([3, 4], {"max_new_tokens": 2})
            async with EngineClient(handles[0].url) as anonymous:
                assert await anonymous.health()  # /health_generate needs no key
                status, _ = await anonymous.http.call("POST", "/generate", {"input_ids": [3]})
                assert status == 401
            for url in (handles[0].url, router):  # the router adds the key towards workers
                async with EngineClient(url, api_key=key) as client:
                    assert len((await client.generate_one(req)).output_ids) == 2

        asyncio.run(go())
    finally:
        launcher.close()
        for h in handles:
            h.stop()

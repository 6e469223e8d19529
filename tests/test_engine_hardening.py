"""No request kills an engine; an engine that cannot generate is relaunched; engines require the
run's key and die with their driver.

The engine, server, fleet and launchers are the real ones. The only faults injected are at the
edges: a forward pre-hook on the engine's model that raises once (a failing step), NaN written
into a model's weights, SIGSTOP on a server process, SIGKILL on a driver process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from aiohttp import web

from asyncrl.engine.client import EngineClient, GenerateRequest
from asyncrl.engine.hf.batch import SamplingParams, Seq
from asyncrl.engine.hf.engine import HFEngine
from asyncrl.engine.hf.launch import launch_hf_server
from asyncrl.engine.hf.server import build_app
from asyncrl.net import free_port
from tests.helpers import random_qwen2, running

KEY = "test-secret-0123456789"
LONG = 2000  # tokens: a request that is still running whatever the box's speed (context 2048)
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def wait_until(pred, what: str, timeout_s: float = 60.0, step_s: float = 0.005):
    deadline = time.monotonic() + timeout_s
    while not (value := pred()):
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(step_s)
    return value


# ---- the scheduler survives any single request ------------------------------------------------
class Fault:
    """Makes the engine model's next prefill or decode forward raise (prefill: > 1 new token)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.armed: str | None = None
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        kind = "prefill" if kwargs["input_ids"].shape[1] > 1 else "decode"
        if self.armed == kind:
            self.armed = None
            raise RuntimeError(f"injected {kind} fault")


@pytest.fixture()
def engine():
    model = random_qwen2(seed=0, eos=1)
    fault = Fault(model)
    eng = HFEngine(model, max_batch_size=4, seed=0)
    eng.start()
    yield eng, fault
    eng.abort()
    eng.stop()


def submit(eng: HFEngine, rid: str, prompt: list[int], params: SamplingParams):
    done = threading.Event()
    seq = Seq(rid, prompt, params, lambda s: done.set())
    eng.submit(seq)
    return seq, done


def test_a_failing_decode_fails_its_batch_and_the_scheduler_goes_on(engine):
    eng, fault = engine
    a, a_done = submit(eng, "a", [3, 4], SamplingParams(LONG, ignore_eos=True))
    wait_until(lambda: len(a.output_ids) >= 2, "tokens of the running request")
    fault.armed = "decode"
    assert a_done.wait(30)
    assert a.finish["type"] == "abort" and "injected decode fault" in a.error
    assert eng.alive and eng.step_failures == 1
    b, b_done = submit(eng, "b", [5, 6], SamplingParams(5, ignore_eos=True))
    assert b_done.wait(30) and b.error is None and b.finish["type"] == "length"


def test_a_failing_prefill_fails_only_the_requests_it_admitted(engine):
    eng, fault = engine
    a, a_done = submit(eng, "a", [3, 4], SamplingParams(LONG, ignore_eos=True))
    wait_until(lambda: len(a.output_ids) >= 2, "tokens of the running request")
    fault.armed = "prefill"
    c, c_done = submit(eng, "c", [5, 6, 7], SamplingParams(4, ignore_eos=True))
    assert c_done.wait(30) and "injected prefill fault" in c.error
    n = len(a.output_ids)
    wait_until(lambda: len(a.output_ids) > n, "the running request to go on")
    assert not a_done.is_set() and a.error is None
    eng.abort("a")
    assert a_done.wait(30) and a.finish["type"] == "abort" and a.error is None


def test_non_finite_logits_fail_the_request_not_the_engine(engine):
    eng, _ = engine
    weight = eng.model.lm_head.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.fill_(float("nan"))
    d, d_done = submit(eng, "d", [3, 4], SamplingParams(4, temperature=1.0))
    assert d_done.wait(30) and "non-finite logits" in d.error
    with torch.no_grad():
        weight.copy_(saved)
    e, e_done = submit(eng, "e", [3, 4], SamplingParams(4, temperature=1.0, ignore_eos=True))
    assert e_done.wait(30) and e.error is None and len(e.output_ids) == 4 and eng.alive


def test_a_failed_request_is_a_one_line_500_and_the_next_is_served(engine):
    eng, fault = engine

    async def go():
        runner = web.AppRunner(build_app(eng, {"group_timeout_s": 5.0}))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with EngineClient(f"http://127.0.0.1:{port}", timeout=30) as c:
                fault.armed = "prefill"
                status, data = await c.http.call("POST", "/generate", {"input_ids": [3, 4, 5]})
                assert status == 500 and "injected prefill fault" in data["message"]
                assert "\n" not in data["message"]
                out = await c.generate_one(GenerateRequest([3, 4], GREEDY))
                assert len(out.output_ids) == 8 and await c.health()
        finally:
            await runner.cleanup()

    asyncio.run(go())


# ---- the real server: hostile sampling params, auth -------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    random_qwen2(path, seed=0, eos=1)
    args = ["--num-threads", "1"]
    handle = launch_hf_server(path, max_batch_size=4, seed=3, extra_args=args, api_key=KEY)
    yield handle
    handle.stop()


def call(url: str, path: str, body: object = None, key: str | None = KEY) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw.strip() else None
    except ValueError:
        return status, raw.decode()


def test_tiny_temperature_and_top_p_are_greedy_and_the_engine_lives(server):
    async def go():
        async with EngineClient(server.url, timeout=60, api_key=KEY) as c:
            greedy = await c.generate_one(GenerateRequest([3, 4, 5], GREEDY))
            for extra in ({"temperature": 1e-45}, {"temperature": 1.0, "top_p": 1e-300}):
                out = await c.generate_one(GenerateRequest([3, 4, 5], {**GREEDY, **extra}))
                assert out.output_ids == greedy.output_ids  # SGLang: temperature < 1e-6 = greedy
            # min_p = 1 keeps only the most likely token: greedy again, sampled at temperature 1
            out = await c.generate_one(GenerateRequest([3, 4, 5], {**GREEDY, "min_p": 1.0, "temperature": 1.0}))  # fmt: skip
            assert out.output_ids == greedy.output_ids
            assert await c.health()

    asyncio.run(go())


@pytest.mark.parametrize(
    "params, fragment",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"sampling_seed": 2**70}, "sampling_seed"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"stop_token_ids": [[1]]}, "stop_token_ids"),
    ],
)
def test_out_of_range_sampling_params_are_a_400_naming_the_field(server, params, fragment):
    status, data = call(server.url, "/generate", {"input_ids": [3], "sampling_params": params})
    assert status == 400 and fragment in data["message"] and "\n" not in data["message"]


def test_every_endpoint_but_health_wants_the_key(server):
    for key in (None, "wrong"):
        for path, body in [("/generate", {"input_ids": [3]}), ("/get_model_info", None)]:
            status, data = call(server.url, path, body, key=key)
            assert status == 401 and "Unauthorized" in data["message"]
        assert call(server.url, "/pause_generation", {"mode": "abort"}, key=key)[0] == 401
    assert call(server.url, "/health", key=None)[0] == 200
    assert call(server.url, "/health_generate", key=None)[0] == 200
    assert call(server.url, "/get_model_info")[0] == 200
    # the key travels in the environment: never on the command line, never in the log
    assert KEY not in server.log_path.read_text()
    if sys.platform.startswith("linux"):
        assert KEY.encode() not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()


# ---- the fleet: an engine that cannot generate is relaunched ---------------------------------
class Source:
    """A WeightSource (the learner's side of a sync): a model's tensors at a version."""

    sync_device = torch.device("cpu")

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model, self.version = AutoModelForCausalLM.from_pretrained(model_dir), 0

    def weights_for_sync(self):
        return iter(self.model.named_parameters())


def test_heal_relaunches_an_engine_that_cannot_generate(tiny_model, tmp_path):
    from asyncrl.config import load_config
    from asyncrl.engine.fleet import EngineFleet
    from asyncrl.net import AsyncRunner

    cfg = load_config(None, [f"output_dir={tmp_path}", "weight_sync.timeout_s=30"])
    runner = AsyncRunner()
    fleet = EngineFleet(
        cfg.actor_infer, cfg.weight_sync, "in_place", tiny_model, tmp_path, seed=0,
        request_timeout_s=60, runner=runner, api_key=KEY,
        health_interval_s=0.2, health_timeout_s=3.0, health_failures=2,
    )  # fmt: skip
    source = Source(tiny_model)
    try:
        fleet.start(source)  # its clients send the key: the group and the sync go through
        slowest = 0.0

        def healthy_round() -> bool:  # heal only reads the background checks: never waits
            nonlocal slowest
            t0 = time.monotonic()
            assert not fleet.heal(source)
            slowest = max(slowest, time.monotonic() - t0)
            return fleet.health.fails.get(0) == 0  # a check round answered: healthy

        wait_until(healthy_round, "a healthy check round", 60, 0.01)
        assert slowest < 0.5
        old = fleet.handles[0].proc
        os.kill(old.pid, signal.SIGSTOP)  # alive, but it cannot generate
        wait_until(lambda: fleet.heal(source), "relaunch of the stopped engine", 120, 0.1)
        assert old.poll() is not None and fleet.handles[0].proc.pid != old.pid
        assert fleet.metrics()["engines/engine_restarts"] == 1

        async def generate():
            async with EngineClient(fleet.handles[0].url, api_key=fleet.api_key) as c:
                return await c.generate_one(GenerateRequest([3, 4], GREEDY))

        assert runner.run(generate()).weight_version == "0"  # relaunched and synced
    finally:
        fleet.stop()
        runner.close()


def test_health_monitor_names_an_engine_that_reports_a_dead_scheduler(tmp_path):
    """An engine whose scheduler died answers /health_generate with 503 (its process lives):
    after `failures` rounds it is named; `poll` itself never waits on the engine."""
    from asyncrl.engine.health import HealthMonitor
    from asyncrl.engine.process import ServerHandle, popen
    from asyncrl.net import AsyncRunner

    async def dead_scheduler(request):
        return web.Response(status=503, text="engine scheduler is not running\n")

    runner = AsyncRunner()
    port = free_port()

    async def serve():
        app = web.Application()
        app.router.add_get("/health_generate", dead_scheduler)
        site_runner = web.AppRunner(app)
        await site_runner.setup()
        await web.TCPSite(site_runner, "127.0.0.1", port).start()
        return site_runner

    site = runner.run(serve())
    with open(tmp_path / "log", "wb") as log:  # a live process stands for the engine's
        proc = popen([sys.executable, "-c", "import time; time.sleep(600)"], os.environ, log)
    handle = ServerHandle(proc, f"http://127.0.0.1:{port}", tmp_path / "log")
    client = EngineClient(handle.url)  # its session is made on the control loop, when used
    monitor = HealthMonitor(runner, interval_s=0.05, timeout_s=5.0, failures=3)
    try:

        def named() -> list[int]:
            t0 = time.monotonic()
            sick = monitor.poll([handle], [client])
            assert time.monotonic() - t0 < 0.5
            assert not sick or monitor.fails[0] >= 3
            return sick

        assert wait_until(named, "the engine named", 30, 0.01) == [0]
    finally:
        monitor.close()
        handle.kill()
        runner.run(client.close())
        runner.run(site.cleanup())
        runner.close()


# ---- engine processes die with their driver ---------------------------------------------------
DRIVER = """
import sys
from pathlib import Path
from asyncrl.engine import sglang as sl
from asyncrl.engine import sglang_process as sp
from asyncrl.engine.hf.launch import launch_hf_server
from asyncrl.net import free_port

model, fake, logs = sys.argv[1:4]
hf = launch_hf_server(model, extra_args=["--num-threads", "1"], log_dir=logs)
settings = sl.SGLangSettings.parse({"env": {"PYTHONPATH": fake}})
port = free_port()
cmd = sl.server_command(model, port, 1, settings)
sg = sp.start_process(cmd, settings.env, f"http://127.0.0.1:{port}", Path(logs) / "sg.log")
sp.wait_healthy(sg, "/health_generate", 90, "fake sglang")
print(hf.proc.pid, sg.proc.pid, flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_engines_die_with_a_sigkilled_driver(tiny_model, tmp_path):
    fake = str(Path(__file__).parent / "fake_sglang")
    cmd = [sys.executable, "-c", textwrap.dedent(DRIVER), str(tiny_model), fake, str(tmp_path)]
    driver = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    pids: list[int] = []
    try:
        line = driver.stdout.readline()  # blocks until both servers are up (or the driver died)
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2 and all(running(p) for p in pids), line
        driver.kill()  # SIGKILL: no cleanup code runs in the driver
        driver.wait()
        wait_until(lambda: not any(running(p) for p in pids), "engine exit", 30, 0.05)
    finally:
        driver.kill()
        for pid in pids:  # the old behaviour: they outlive the driver; do not leak them
            if running(pid):
                os.kill(pid, signal.SIGKILL)

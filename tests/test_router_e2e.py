"""The real sglang-router (the PyPI wheel's native binary, CPU) in front of two engine servers:
asyncrl hf engine servers (generation through the router, control calls to each worker, a
killed worker that is relaunched on its port re-admitted, the router's Prometheus exporter on
loopback and a free port: two routers on one host, which sglang-router's default
0.0.0.0:29000 forbids); fake SGLang servers (tests/fake_sglang) driven by the rollout
worker's own request path (groups, continuations, evaluation; LoRA on and off), every body
checked against SGLang's request structs; and engines paused longer than the router's health
window (a stub that answers /health as a paused SGLang does), which the router must keep.

Skips, saying so, when `sglang_router` is not installed (it is in the `test` extra).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp import web

from asyncrl.config.schema import LoggingConfig
from asyncrl.data.prompts import PromptItem
from asyncrl.engine import sglang as sl
from asyncrl.engine.client import EngineClient, EngineError, GenerateRequest
from asyncrl.engine.hf.launch import launch_hf_server
from asyncrl.net import free_port
from asyncrl.rollout.evaluation import Evaluator
from asyncrl.rollout.settings import RolloutSettings
from asyncrl.rollout.single_turn import GroupBuilder, generate_continued
from asyncrl.weights.lora_native import NativeLoraSync
from tests.test_hf_server import make_tiny_model
from tests.test_lora_native import _tensors, start_lora_fake
from tests.test_sglang_backend import state
from tests.test_sglang_versions import start_fake

pytestmark = [
    pytest.mark.timing,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang_router") is None,
        reason="sglang-router is not installed (pip install -e '.[test]')",
    ),
]
SETTINGS = sl.SGLangSettings.parse({"router_policy": "round_robin"})


def start_router(urls: list[str], tmp_path: Path, settings: sl.SGLangSettings = SETTINGS):
    """As `SGLangLauncher._start_router`: the command asyncrl builds, healthy or an error."""
    port = free_port()
    cmd = sl.router_command(urls, port, settings)
    log = tmp_path / f"router_{port}.log"
    handle = sl.start_process(cmd, {}, f"http://127.0.0.1:{port}", log)
    return sl.wait_healthy(handle, "/health", 60, "sglang router"), cmd


async def versions_through(router: str, n: int) -> set[str]:
    """The weight versions of `n` requests through the router (failed ones left out)."""
    seen = set()
    async with EngineClient(router, timeout=30) as client:
        for _ in range(n):
            try:
                c = await client.generate_one(
                    GenerateRequest([3, 4], {"max_new_tokens": 2, "ignore_eos": True})
                )
            except EngineError:  # a worker being relaunched
                continue
            assert len(c.output_logprobs) == len(c.output_ids) == 2
            seen.add(c.weight_version)
    return seen


async def set_versions(urls: list[str], versions: list[str]) -> None:
    """Control calls go to each worker directly, never through the router."""
    for url, v in zip(urls, versions, strict=True):
        async with EngineClient(url) as client:
            await client.pause("in_place")
            await client.update_weight_version(v)
            await client.resume()


def test_real_router_routes_readmits_a_relaunched_worker_and_exports_on_loopback(tmp_path):
    make_tiny_model(tmp_path)
    args = ["--num-threads", "1"]
    workers = [launch_hf_server(tmp_path, extra_args=args) for _ in range(2)]
    routers = []
    try:
        urls = [w.url for w in workers]
        for _ in range(2):  # a second router on the host: no exporter port clash
            routers.append(start_router(urls, tmp_path))
        (router, cmd), (second, _) = routers
        asyncio.run(set_versions(urls, ["1", "2"]))
        assert asyncio.run(versions_through(router.url, 4)) == {"1", "2"}  # both workers serve
        assert asyncio.run(versions_through(second.url, 2)) == {"1", "2"}

        host = cmd[cmd.index("--prometheus-host") + 1]
        port = cmd[cmd.index("--prometheus-port") + 1]
        assert host == "127.0.0.1" and port != "29000"
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
            assert r.status == 200 and b"smg_" in r.read()

        workers[1].kill()  # relaunched on its own port: the router's URL stays valid
        port1 = int(urls[1].rsplit(":", 1)[1])
        workers[1] = launch_hf_server(tmp_path, port=port1, extra_args=args)
        asyncio.run(set_versions([urls[1]], ["3"]))
        deadline = time.monotonic() + 90
        seen: set[str] = set()
        while "3" not in seen:  # re-admitted once its health checks pass again
            assert time.monotonic() < deadline, f"relaunched worker never re-admitted: {seen}"
            seen = asyncio.run(versions_through(router.url, 4))
            time.sleep(0 if "3" in seen else 0.2)  # poll interval while it is out
        assert router.proc.poll() is None
    finally:
        for handle, _ in routers:
            handle.stop()
        for w in workers:
            w.stop()


# ---- the rollout worker's request path through the router --------------------------------------
def generate_calls(url: str) -> list[dict]:
    return [body for path, body in state(url)["calls"] if path == "/generate"]


def test_real_router_answers_the_rollout_workers_batched_and_single_requests(tmp_path, tiny_model):
    """Groups (`generate`, n samples each, several prompts at once), a continuation
    (`generate_one`) and evaluation: every request answered 200 through the real router, with
    and without LoRA. sglang-router types `sampling_params`, `return_logprob`, `rid` and
    `extra_key` as single values: a worker's client made with the fleet's `routed()` sends one
    request per sample, each reaching a worker with its cache namespace and adapter."""
    fakes = [start_lora_fake(tmp_path, "0.5.23") for _ in range(2)]
    router = None
    try:
        urls = [f.url for f in fakes]
        router, _ = start_router(urls, tmp_path)
        asyncio.run(refused_batch(router.url))  # why router=True exists
        for lora in (False, True):
            asyncio.run(rollout_through(router.url, urls, tmp_path, tiny_model, lora))
        calls = [generate_calls(u) for u in urls]
        assert all(calls), "both workers serve"
        bodies = [b for c in calls for b in c]
        probes = [b for b in bodies if b["input_ids"] == [0]]  # LoRA's `refresh_lora`
        evals = [b for b in bodies if "priority" in b]  # on each engine, as the fleet's clients
        rollout = [b for b in bodies if b not in probes and b not in evals]
        assert len(rollout) == 2 * (3 * 3 + 1)  # per pass: 3 groups of 3, 1 continuation
        for body in rollout:  # the single form, one sample each
            assert isinstance(body["input_ids"][0], int) and isinstance(body["extra_key"], str)
        assert [b.get("lora_path") for b in rollout].count("asyncrl-v0") == 10  # LoRA's pass
        assert len(evals) == 4 and all(isinstance(b["input_ids"][0], list) for b in evals)
        assert all(isinstance(b["extra_key"], str) for b in evals)  # never a list: SGLang < 0.5.15
        assert [state(u)["violations"] for u in urls] == [[], []]
    finally:
        if router is not None:
            router.stop()
        for f in fakes:
            f.stop()


@pytest.mark.parametrize(
    ("router", "devices", "dedicated", "routed"),
    [("auto", "[0]", False, False), ("auto", "[0,1]", False, True), (False, "[0,1]", False, False),
     (True, "[0]", False, True), ("auto", "[0,1]", True, False)],
)  # fmt: skip
def test_the_fleet_says_whether_rollout_workers_reach_a_router(
    tmp_path, router, devices, dedicated, routed
):
    """`EngineFleet.routed` (what `Startup.settings` hands rollout workers as
    `RolloutSettings.engine_router`) is true exactly when `urls_for_worker` is the router:
    SGLang with `router: true`, or auto with more than one rollout engine (a dedicated
    evaluation engine is not one); never on hf_infer."""
    from asyncrl.engine.fleet import EngineFleet
    from asyncrl.net import AsyncRunner
    from tests.test_sglang_backend import infer_cfg

    cfg = infer_cfg(tmp_path, tp=1, devices=devices, router=router)
    runner = AsyncRunner()
    try:
        fleet = EngineFleet(
            cfg.actor_infer, cfg.weight_sync, "abort", tmp_path, tmp_path, seed=0,
            request_timeout_s=5.0, runner=runner, dedicated_eval=dedicated,
        )  # fmt: skip
        assert fleet.routed() is routed
        cfg.actor_infer.strategy_args.strategy_name = "hf_infer"
        hf = EngineFleet(
            cfg.actor_infer, cfg.weight_sync, "abort", tmp_path, tmp_path, seed=0,
            request_timeout_s=5.0, runner=runner,
        )  # fmt: skip
        assert hf.routed() is False
    finally:
        runner.close()


async def refused_batch(router: str) -> None:
    async with EngineClient(router, timeout=30) as client:
        with pytest.raises(EngineError, match="HTTP 422.*sampling_params"):
            await client.generate([GenerateRequest([3], {"sampling_seed": i}) for i in range(2)])


async def rollout_through(
    router: str, urls: list[str], tmp_path: Path, model: Path, lora: bool
) -> None:
    """What a rollout worker (through the router) and the evaluator (on each engine) send."""
    direct = [EngineClient(u, timeout=30, lora=lora) for u in urls]  # the fleet's clients
    settings = RolloutSettings(
        [router], "127.0.0.1", 1, str(model), n=3, response_length=3, engine_router=True,
        engine_lora=lora,
    )  # fmt: skip
    builder = GroupBuilder(settings)
    try:
        if lora:  # the engines hold adapter asyncrl-v0 before any request names it
            await NativeLoraSync(tmp_path / "lora", timeout_s=30).sync(direct, _tensors(), 0, None)
        items = [PromptItem(f"p{i}", [3, 4 + i], "1+1", {"answer": "2"}) for i in range(3)]
        groups = await asyncio.gather(*(builder.build(it) for it in items))
        assert [list(g.response_lengths) for g in groups] == [[3, 3, 3]] * 3
        request = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}}
        (client,) = builder.clients
        done = await generate_continued(client, request, 2)  # a continuation: generate_one
        assert len(done.output_ids) == 2
        fleet = SimpleNamespace(clients=direct, eval_clients=lambda: direct, eval_index=None)
        ev = Evaluator(LoggingConfig(eval_priority=-1), 10, items, settings, fleet)
        outs, _ = await ev._generate(direct, 0, await ev._pin(direct, 0))
        assert len(outs) == 3
    finally:
        for c in [*direct, *builder.clients]:
            await c.close()


# ---- a weight sync longer than the router's health window --------------------------------------
REPLY = {
    "output_ids": [5],
    "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "1", "prompt_tokens": 1},
}


class PausedSGLang:
    """The edge: an engine that answers as SGLang (0.5.6 to 0.5.23) does around a pause. Its
    `/health` and `/health_generate` generate a token (`SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`
    on by default), so while paused they wait up to `hold_s` (`SGLANG_HEALTH_CHECK_TIMEOUT`,
    20 s) and answer 503; /generate arrivals wait in the tokenizer manager until
    /continue_generation. Served on a thread of its own (`held`: /generate calls waiting)."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s, self.held = hold_s, 0
        self.url = f"http://127.0.0.1:{free_port()}"
        self._loop = asyncio.new_event_loop()
        self._up = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._up.wait(30), "stub engine did not start"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self.running = asyncio.Event()
        self.running.set()
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/pause_generation", self.control)
        app.router.add_post("/continue_generation", self.control)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        port = int(self.url.rsplit(":", 1)[1])
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", port).start())
        self._up.set()
        self._loop.run_forever()

    async def health(self, request: web.Request) -> web.Response:
        try:
            await asyncio.wait_for(self.running.wait(), self.hold_s)
        except TimeoutError:
            return web.Response(status=503)
        return web.Response(status=200)

    async def generate(self, request: web.Request) -> web.Response:
        await request.json()
        self.held += not self.running.is_set()
        await self.running.wait()
        return web.json_response(REPLY)

    async def control(self, request: web.Request) -> web.Response:
        paused = request.path == "/pause_generation"
        (self.running.clear if paused else self.running.set)()
        return web.json_response({"message": "ok", "status": "ok"})

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def worker_health(router: str) -> list[bool]:
    """The router's view of its workers (sglang-router's GET /workers), in URL order."""
    with urllib.request.urlopen(router + "/workers", timeout=10) as r:
        workers = json.loads(r.read())["workers"]
    return [w["is_healthy"] for w in sorted(workers, key=lambda w: w["url"])]


async def until(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f}s"
        await asyncio.sleep(0.05)  # polling another process's state, bounded by the deadline


def test_the_router_keeps_every_worker_through_a_sync_longer_than_its_health_window(tmp_path):
    """Two routers with a short health window (checks every 1 s, out after 1 failure): the
    command asyncrl builds (`router_command`: the checks off unless `disable_health_check:
    false`) and one with them on. Both engines paused, as a weight sync pauses them, until
    the window has dropped them from the second router: ours still holds both, a request sent
    to it mid-sync waits in the engines and is answered 200 once they continue; the other
    answers 503 "no available workers" meanwhile."""
    engines = [PausedSGLang(hold_s=5) for _ in range(2)]
    window = {"health_check_interval_secs": 1, "health_failure_threshold": 1,
              "health_success_threshold": 1, "health_check_timeout_secs": 1}  # fmt: skip
    checked = sl.SGLangSettings.parse({"router_args": {**window, "disable_health_check": False}})
    with pytest.raises(sl.SGLangConfigError, match="disable_health_check: false"):
        sl.SGLangSettings.parse({"router_args": window})  # checks that are off: refused
    ours = replace(SETTINGS, router_args=window)  # the same window, the checks left as asyncrl's
    routers = []
    try:
        urls = [e.url for e in engines]
        routers = [start_router(urls, tmp_path, ours)[0], start_router(urls, tmp_path, checked)[0]]
        asyncio.run(sync_through(engines, *(r.url for r in routers)))
    finally:
        for handle in routers:
            handle.stop()
        for e in engines:
            e.stop()


async def sync_through(engines: list[PausedSGLang], ours: str, checked: str) -> None:
    req = GenerateRequest([3], {"max_new_tokens": 1}, return_logprob=False)
    control = [EngineClient(e.url, control_timeout=10) for e in engines]  # the fleet's clients
    async with EngineClient(ours, timeout=60, router=True) as worker:
        await until(lambda: worker_health(checked) == [True, True], "checked router ready")
        for client in control:  # the sync starts: every engine paused
            await client.pause("in_place")
        await until(lambda: worker_health(checked) == [False, False], "the window drops them")
        assert worker_health(ours) == [True, True]
        async with EngineClient(checked, timeout=30, router=True) as other:
            with pytest.raises(EngineError, match="HTTP 503"):
                await other.generate_one(req)
        pending = asyncio.ensure_future(worker.generate([req, req]))
        await until(lambda: sum(e.held for e in engines) == 2, "both requests reach the engines")
        assert not pending.done()
        for client in control:  # the sync ends
            await client.resume()
            await client.close()
        assert [c.version for c in await pending] == [1, 1]


def test_routed_experts_reach_the_engines_directly_since_the_router_drops_them(tmp_path):
    """`actor.router_replay: r3` with SGLang engines: the real sglang-router forwards /generate
    as its own typed struct, without `return_routed_experts` (the upstream fact behind
    `sglang.ROUTES_FLAG`: with the flag, `router: auto` sends rollout workers to the engines
    directly); there, the worker's `meta_info["routed_experts"]` reaches the client whole
    (prompt + output - 1 rows). If a router release starts forwarding the field, this says so."""
    layers, top_k = 2, 2  # the fake's (fake_server.ROUTED_LAYERS, ROUTED_TOP_K)
    worker = start_fake(tmp_path, "0.5.23", 0.0, {sl.ROUTES_FLAG: True})
    router = None
    request = GenerateRequest([3, 4, 5], {"max_new_tokens": 3, "ignore_eos": True},
                              return_routed_experts=True)  # fmt: skip

    async def ask(url: str, routed: bool):
        async with EngineClient(url, timeout=30, router=routed) as client:
            return await client.generate_one(request)

    try:
        router, _ = start_router([worker.url], tmp_path)
        with pytest.raises(EngineError, match="routed_experts"):
            asyncio.run(ask(router.url, True))
        (forwarded,) = generate_calls(worker.url)
        assert "return_routed_experts" not in forwarded  # dropped by the router
        done = asyncio.run(ask(worker.url, False))
        assert generate_calls(worker.url)[-1]["return_routed_experts"] is True
        tokens = [3, 4, 5, *done.output_ids]
        assert done.routed_experts.shape == (len(tokens) - 1, layers * top_k)
        expected = [(4 + layer + k) % 8 for layer in range(layers) for k in range(top_k)]
        assert done.routed_experts[1].tolist() == expected
        assert [state(worker.url)["violations"]] == [[]]
        routes = sl.SGLangLauncher.routes  # the launcher's decision, on its settings alone
        flagged = sl.SGLangSettings.parse({sl.ROUTES_FLAG: True})
        assert not routes(SimpleNamespace(settings=flagged), 2)
        assert routes(SimpleNamespace(settings=sl.SGLangSettings.parse({})), 2)
    finally:
        if router is not None:
            router.stop()
        worker.stop()

"""A dedicated evaluation engine (`logging.eval_engine: dedicated`, issue 16).

The real loop with two hf engines on the CPU; in front of each engine server an HTTP
pass-through records what reaches it (the only thing the test adds: the launcher is wrapped to
hand out the pass-through's URL, the real server answers). Rollout requests (no priority)
must reach engine 0 only, evaluation requests (priority `logging.eval_priority`) engine 1
only; every weight sync reaches engine 0, the evaluation steps' engine 1 too."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.config.schema import ConfigError

FORWARDED = ("authorization", "content-type")


class RecordingProxy:
    """Forwards every HTTP call to `target` unchanged (method, path, body, auth header) and
    records each call's path and, for /generate, its JSON body. Serves on its own thread."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.calls: list[tuple[str, dict | list | None]] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(30), "proxy did not start"

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        import aiohttp
        from aiohttp import web

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        app = web.Application(client_max_size=256 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _forward(self, request):
        from aiohttp import web

        body = await request.read()
        self.calls.append((request.path, json.loads(body) if request.path == "/generate" else None))
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        url = self.target + request.path_qs
        async with self._session.request(request.method, url, data=body, headers=headers) as r:
            return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)

    def generate_bodies(self) -> list:
        return [body for path, body in self.calls if path == "/generate"]

    def count(self, path: str) -> int:
        return sum(p == path for p, _ in self.calls)

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()
            await self._session.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


def shrunk(model_dir: Path, out: Path, *extra: str):
    return load_config(
        None,
        [
            f"actor_train.model_args.model_name_or_path={model_dir}",
            f"output_dir={out}",
            "max_steps=4",
            "rollout_batch_size=2",
            "num_return_sequences_in_group=2",
            "response_length=4",
            "actor_infer.device_mapping=[0,1]",
            "rollout.num_actors=2",
            "rollout.max_inflight_prompts=2",
            "rollout.reward_fn=tests.e2e_rewards:digit_fraction",
            "logging.eval_interval=2",
            "logging.eval_size=6",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.plots=false",
            "actor.checkpoint.save_contents=[]",
            "actor_train.model_args.disable_gradient_checkpointing=true",
            *extra,
        ],
    )


def is_eval(body: dict | list) -> bool:
    """Evaluation requests carry a priority (logging.eval_priority -1); rollout's carry none."""
    return isinstance(body, dict) and body.get("priority") == -1


def test_dedicated_engine_serves_evaluation_alone(tiny_model, tmp_path):
    from asyncrl.engine.hf.launch import HFLauncher
    from asyncrl.run import run

    proxies: dict[int, RecordingProxy] = {}
    # Where an engine's URL is made: `spawn` (started, not yet waited on) when the launcher
    # has it, else `launch`; the proxy's URL is what the fleet and the workers then see.
    name = "spawn" if hasattr(HFLauncher, "spawn") else "launch"
    start = getattr(HFLauncher, name)

    def proxied(self, index, port=None):
        handle = start(self, index, port)
        proxies[index] = RecordingProxy(handle.url)
        return dataclasses.replace(handle, url=f"http://127.0.0.1:{proxies[index].port}")

    mp = pytest.MonkeyPatch()
    mp.setattr(HFLauncher, name, proxied)
    try:
        run(shrunk(tiny_model, tmp_path, "logging.eval_engine=dedicated"))
    finally:
        mp.undo()
        for proxy in proxies.values():
            proxy.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if "eval/accuracy" in r}
    assert sorted(evals) == [0, 2, 4]  # every due evaluation landed, on its own step
    assert all(r["eval/version"] == r["step"] for r in evals.values())  # pinned to its weights
    assert sorted(proxies) == [0, 1]  # both engines were started behind a proxy
    rollout_engine, eval_engine = proxies[0].generate_bodies(), proxies[1].generate_bodies()
    assert rollout_engine and not any(is_eval(b) for b in rollout_engine)
    assert all(is_eval(b) for b in eval_engine)  # 3 evaluations x 6 prompts, batched, each
    # after a request of no tokens that starts its version's lease (rollout/evaluation.py)
    leases = [b for b in eval_engine if b["input_ids"] == [0]]  # not batched: one request
    assert [b["pin_weight_version"] for b in leases] == ["0", "2", "4"]
    assert sorted(len(b["input_ids"]) for b in eval_engine if b not in leases) == [6, 6, 6]
    # The rollout engine gets every version (the initial push and steps 1-4); the evaluation
    # engine, in a weight group of its own, the initial push and the evaluation steps' (2, 4)
    # alone, and no sync between two evaluations waited for the one in flight.
    syncs = [p.count("/update_weights_from_distributed") for p in (proxies[0], proxies[1])]
    assert syncs[1] > 0 and syncs[0] * 3 == syncs[1] * 5, syncs
    assert all(r["learner/eval_wait_seconds"] == 0.0 for r in rows if r["step"] in (1, 3))


class _Handle:
    def __init__(self, url: str) -> None:
        self.url = url


def _unlaunched_fleet(cfg, model_dir, out, runner, dedicated: bool):
    """A real EngineFleet whose engines are never launched (routing reads handles only)."""
    from asyncrl.engine.fleet import EngineFleet

    return EngineFleet(
        cfg.actor_infer, cfg.weight_sync, "abort", model_dir, out, seed=0,
        request_timeout_s=5.0, runner=runner, dedicated_eval=dedicated,
    )  # fmt: skip


@pytest.mark.parametrize("dedicated", [False, True])
def test_routing_keeps_rollout_off_the_evaluation_engine(tiny_model, tmp_path, dedicated):
    from asyncrl.net import AsyncRunner

    cfg = shrunk(tiny_model, tmp_path)
    runner = AsyncRunner()
    try:
        fleet = _unlaunched_fleet(cfg, tiny_model, tmp_path, runner, dedicated)
        fleet.handles = [_Handle(f"http://127.0.0.1:{9000 + i}") for i in range(2)]  # no launch
        fleet.clients = ["client0", "client1"]  # routing only reads them
        workers = {url for i in range(4) for url in fleet.urls_for_worker(i)}
        groups = {e: [(s.group_name, c) for s, c in fleet._groups(e)] for e in (True, False)}
        if dedicated:
            assert workers == {"http://127.0.0.1:9000"}
            assert fleet.eval_clients() == ["client1"]
            # weight groups: the rollout engines', and the evaluation engine's own, which a
            # sync reaches only when it says so (an evaluation step's)
            rollout = (fleet.sender.group_name, ["client0"])
            assert groups[True] == [rollout, ("asyncrl_weights_eval", ["client1"])]
            assert groups[False] == [rollout]
        else:
            assert workers == {"http://127.0.0.1:9000", "http://127.0.0.1:9001"}
            assert fleet.eval_clients() == ["client0", "client1"]
            assert fleet.eval_sender is None
            assert groups[True] == groups[False] == [(fleet.sender.group_name, fleet.clients)]
    finally:
        runner.close()


class _RouterLauncher:
    """Stands in for SGLang's launcher (a router in front of the engines, placement options)."""

    def __init__(self) -> None:
        self.routed: list[list[str]] = []

    def actor_urls(self, worker_urls: list[str]) -> list[str]:
        self.routed.append(list(worker_urls))
        return ["http://router"]

    def actor_options(self, engine: int) -> dict:
        return {"engine": engine}


def test_router_and_placement_get_the_rollout_engines_only(tiny_model, tmp_path):
    from asyncrl.net import AsyncRunner

    cfg = shrunk(tiny_model, tmp_path, "actor_infer.device_mapping=[0,1,2]")
    runner = AsyncRunner()
    try:
        fleet = _unlaunched_fleet(cfg, tiny_model, tmp_path, runner, True)
        fleet.handles = [_Handle(f"http://127.0.0.1:{9000 + i}") for i in range(3)]
        fleet.launcher = launcher = _RouterLauncher()
        assert fleet.urls_for_worker(1) == ["http://router"]
        assert launcher.routed == [["http://127.0.0.1:9000", "http://127.0.0.1:9001"]]
        # multi-node: workers are placed beside rollout engines 0 and 1, never engine 2
        assert [fleet.worker_options(i)["engine"] for i in range(4)] == [0, 1, 0, 1]
    finally:
        runner.close()


def test_dedicated_needs_two_engines_and_evaluation(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="eval_engine: dedicated needs >= 2 engines.*has 1"):
        shrunk(
            tiny_model, tmp_path, "logging.eval_engine=dedicated", "actor_infer.device_mapping=[]"
        )
    with pytest.raises(ConfigError, match="eval_interval is 0"):
        shrunk(tiny_model, tmp_path, "logging.eval_engine=dedicated", "logging.eval_interval=0")
    assert shrunk(tiny_model, tmp_path, "logging.eval_engine=dedicated").logging.eval_engine == (
        "dedicated"
    )

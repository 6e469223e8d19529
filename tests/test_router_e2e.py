"""The real sglang-router (the PyPI wheel's native binary, CPU) in front of two asyncrl hf engine
servers: generation through the router, control calls to each worker, a killed worker that
is relaunched on its port re-admitted, and the router's Prometheus exporter on loopback and a
free port (two routers on one host, which sglang-router's default 0.0.0.0:29000 forbids).

Skips, saying so, when `sglang_router` is not installed (it is in the `test` extra).
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
import urllib.request
from pathlib import Path

import pytest

from asyncrl.engine import sglang as sl
from asyncrl.engine.client import EngineClient, EngineError, GenerateRequest
from asyncrl.engine.hf.launch import launch_hf_server
from asyncrl.net import free_port
from tests.test_hf_server import make_tiny_model

pytestmark = [
    pytest.mark.timing,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang_router") is None,
        reason="sglang-router is not installed (pip install -e '.[test]')",
    ),
]
SETTINGS = sl.SGLangSettings.parse({"router_policy": "round_robin"})


def start_router(urls: list[str], tmp_path: Path):
    """As `SGLangLauncher._start_router`: the command asyncrl builds, healthy or an error."""
    port = free_port()
    cmd = sl.router_command(urls, port, SETTINGS)
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

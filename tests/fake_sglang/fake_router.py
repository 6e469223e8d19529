"""A stand-in for sglang-router's CLI (`python -m sglang_router.launch_router`): round-robin
/generate over the workers (refusing SGLang's batch form with 422, as sglang-router does),
/v1/models from the first worker, SGLang's flag names (an unknown flag exits 2)."""

from __future__ import annotations

import argparse
import json
import sys

from aiohttp import ClientSession, web


def single_form_problem(body: object) -> str:
    """sglang-router 0.3.2 types these /generate fields as single values: a list (SGLang's
    batch form) is refused with 422 before any worker sees it."""
    for key in ("sampling_params", "return_logprob", "rid", "extra_key"):
        if isinstance(body, dict) and isinstance(body.get(key), list):
            return f"Failed to deserialize the JSON body into the target type: {key}: sequence"
    return ""


def main_router() -> None:
    p = argparse.ArgumentParser("sglang_router.launch_router (fake)")
    p.add_argument("--worker-urls", nargs="+", required=True)
    p.add_argument("--policy", choices=["random", "round_robin", "cache_aware", "power_of_two"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--balance-abs-threshold", type=int)
    p.add_argument("--api-key", type=str)
    p.add_argument("--prometheus-host", type=str)
    p.add_argument("--prometheus-port", type=int)
    p.add_argument("--disable-health-check", action="store_true")
    for flag in ("--health-check-interval-secs", "--health-failure-threshold"):
        p.add_argument(flag, type=int)
    args = p.parse_args()
    turn = {"i": 0}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async def proxy(request: web.Request) -> web.Response:
        url = args.worker_urls[turn["i"] % len(args.worker_urls)]
        turn["i"] += 1
        body = await request.read()
        if problem := single_form_problem(json.loads(body or b"{}")):  # as sglang-router 0.3.2
            return web.Response(status=422, text=problem)
        async with ClientSession(headers=headers) as s, s.post(url + "/generate", data=body) as r:
            return web.Response(
                status=r.status, body=await r.read(), content_type="application/json"
            )

    async def models(request: web.Request) -> web.Response:  # the router asks a worker
        async with (
            ClientSession(headers=headers) as s,
            s.get(args.worker_urls[0] + "/v1/models") as r,
        ):
            return web.Response(
                status=r.status, body=await r.read(), content_type="application/json"
            )

    app = web.Application()
    app.router.add_get("/health", lambda r: web.Response(status=200))
    app.router.add_post("/generate", proxy)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/_fake/state", lambda r: web.json_response({"argv": sys.argv[1:]}))
    web.run_app(app, host=args.host, port=args.port, print=None)

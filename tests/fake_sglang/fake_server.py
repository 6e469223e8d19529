"""A stand-in for SGLang's HTTP server and for sglang-router, for CPU tests (the edge only).

SGLang itself cannot be installed here. This fake takes the command line asyncrl builds
(argparse with SGLang's flag names; an unknown flag exits 2, as SGLang does), serves the
native endpoints asyncrl uses with SGLang's reply shapes, and checks every request body against
SGLang's request structs (`sglang/srt/managers/io_struct.py`, 0.5.x): a missing, mistyped or
unknown field is a protocol violation, recorded and answered with HTTP 400. Its tensor-parallel
ranks are separate processes, as SGLang's schedulers are; each joins the weight-update group
exactly like SGLang's `init_custom_process_group` (tcp rendezvous, `PrefixStore(group_name)`,
torch's group helper) and receives buckets like SGLang's model runner: per tensor, or one
unpadded uint8 `flattened_bucket` sliced per tensor and viewed as its dtype. What it received
(sha256 per tensor per rank), its argv and its device visibility are at GET /_fake/state.
With `--api-key K` every endpoint but /health* (and /_fake/state, the test's own) wants
`Authorization: Bearer K`, else 401 {"error": "Unauthorized"} -- SGLang's middleware; the fake
router's `--api-key` is what it sends to the workers, as sglang-router's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import multiprocessing as mp
import os
import sys

from aiohttp import ClientSession, web

VOCAB = 64
NONE = type(None)
# Request structs (field -> (accepted JSON types, required)), from SGLang's io_struct.py.
SCHEMAS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "/generate": {
        "input_ids": ((list,), True), "sampling_params": ((dict,), False),
        "return_logprob": ((bool,), False), "logprob_start_len": ((int,), False),
        "rid": ((str,), False), "stream": ((bool,), False),
    },
    "/pause_generation": {"mode": ((str,), False)},
    "/continue_generation": {"torch_empty_cache": ((bool,), False)},
    "/init_weights_update_group": {
        "master_address": ((str,), True), "master_port": ((int,), True),
        "rank_offset": ((int,), True), "world_size": ((int,), True),
        "group_name": ((str,), False), "backend": ((str,), False),
    },
    "/update_weights_from_distributed": {
        "names": ((list,), True), "dtypes": ((list,), True), "shapes": ((list,), True),
        "group_name": ((str,), False), "flush_cache": ((bool,), False),
        "abort_all_requests": ((bool,), False), "weight_version": ((str, NONE), False),
        "load_format": ((str, NONE), False), "torch_empty_cache": ((bool,), False),
    },
    "/destroy_weights_update_group": {"group_name": ((str,), False)},
    "/update_weight_version": {"new_version": ((str,), True), "abort_all_requests": ((bool,), False)},
}  # fmt: skip
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                 "stop_token_ids", "ignore_eos", "skip_special_tokens", "n", "sampling_seed",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens"}  # fmt: skip
PAUSE_MODES = ("abort", "retract", "in_place")


def violations_of(path: str, body: object) -> list[str]:
    schema = SCHEMAS[path]
    if not isinstance(body, dict):
        return [f"{path}: body is not a JSON object"]
    out = [f"{path}: unknown field {k!r}" for k in body if k not in schema]
    for key, (types, required) in schema.items():
        if key not in body:
            out += [f"{path}: missing {key!r}"] if required else []
        elif not isinstance(body[key], types) or (
            isinstance(body[key], bool) and bool not in types
        ):
            out.append(f"{path}: {key!r}={body[key]!r} is not {types}")
    if path == "/generate":
        ids = body.get("input_ids")
        if not (isinstance(ids, list) and ids and all(type(t) is int for t in ids)):
            out.append("/generate: input_ids must be a non-empty list of ints")
        out += [f"/generate: unknown sampling param {k!r}"
                for k in body.get("sampling_params") or {} if k not in SAMPLING_KEYS]  # fmt: skip
    if path == "/pause_generation" and body.get("mode", "abort") not in PAUSE_MODES:
        out.append(f"/pause_generation: mode {body.get('mode')!r}")
    if path == "/update_weights_from_distributed":
        if (
            not len(body.get("names", []))
            == len(body.get("dtypes", []))
            == len(body.get("shapes", []))
        ):
            out.append("/update_weights_from_distributed: names/dtypes/shapes lengths differ")
        out += [f"dtype {d!r} is not a bare torch dtype name" for d in body.get("dtypes", [])
                if not isinstance(d, str) or d.startswith("torch.")]  # fmt: skip
    return out


# ---- tensor-parallel rank processes ------------------------------------------------------------
def _join(args: dict, tp_rank: int):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=30)
    if args.get("backend", "nccl") == "nccl":  # a GPU per TP rank, as SGLang's schedulers
        import torch

        torch.cuda.set_device(tp_rank)
    rank = args["rank_offset"] + tp_rank
    url = f"tcp://{args['master_address']}:{args['master_port']}"
    store, _, _ = next(rendezvous(url, rank, args["world_size"], timeout=timeout))
    store.set_timeout(timeout)
    name = args.get("group_name", "weight_update_group")
    pg, _ = _new_process_group_helper(
        args["world_size"], rank, [], dist.Backend(args.get("backend", "nccl")),
        dist.PrefixStore(name, store), group_name=name, timeout=timeout,
    )  # fmt: skip
    _world.pg_group_ranks[pg] = {i: i for i in range(args["world_size"])}
    return pg


def _receive(pg, body: dict, device: str) -> dict[str, str]:
    import torch
    import torch.distributed as dist

    def bcast(t):
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return pg.broadcast([t], opts)

    empties = [
        torch.empty(s, dtype=getattr(torch, d), device=device)
        for d, s in zip(body["dtypes"], body["shapes"])
    ]
    if body.get("load_format") == "flattened_bucket":
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in empties])  # unpadded, in order
        bcast(flat).wait()
        tensors, start = [], 0
        for t in empties:
            n = t.numel() * t.element_size()
            tensors.append(flat[start : start + n].view(t.dtype).reshape(t.shape))
            start += n
    else:
        works = [bcast(t) for t in empties]
        for w in works:
            w.wait()
        tensors = empties
    return {
        name: hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
        for name, t in zip(body["names"], tensors)
    }


def rank_worker(conn, tp_rank: int) -> None:
    groups: dict = {}  # group name -> (process group, receive device)
    while True:
        cmd, args = conn.recv()
        name = args.get("group_name", "weight_update_group") if isinstance(args, dict) else None
        try:
            if cmd == "init":
                device = f"cuda:{tp_rank}" if args.get("backend", "nccl") == "nccl" else "cpu"
                groups[name] = (_join(args, tp_rank), device)
                conn.send(("ok", None))
            elif cmd == "update":
                pg, device = groups[name]
                conn.send(("ok", _receive(pg, args, device)))
            elif cmd == "destroy":
                entry = groups.pop(name, None)
                if entry is not None:  # as SGLang's model runner does
                    import torch.distributed as dist

                    dist.destroy_process_group(entry[0])
                conn.send(("ok", None))
            else:
                return
        except Exception as e:  # noqa: BLE001 - reported to the HTTP process as SGLang would
            conn.send(("error", f"{type(e).__name__}: {e}"))


# ---- the HTTP server ---------------------------------------------------------------------------
class FakeSGLang:
    def __init__(self, args: argparse.Namespace) -> None:
        ctx = mp.get_context("spawn")
        self.args, self.conns, self.procs = args, [], []
        for r in range(args.tp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_worker, args=(child, r), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.version, self.paused = "default", asyncio.Event()
        self.paused.set()  # set = running
        self.violations: list[str] = []
        self.calls: list[list] = []
        self.received: list[dict[str, str]] = [{} for _ in range(args.tp_size)]

    async def ranks(self, cmd: str, body: dict) -> tuple[bool, str, list]:
        for c in self.conns:
            c.send((cmd, body))
        replies = await asyncio.gather(*(asyncio.to_thread(c.recv) for c in self.conns))
        errors = [msg for status, msg in replies if status != "ok"]
        return not errors, "; ".join(errors), [msg for _, msg in replies]

    async def checked(self, request: web.Request) -> dict | web.Response:
        body = await request.json() if request.can_read_body else {}
        self.calls.append([request.path, body])
        problems = violations_of(request.path, body)
        if problems:
            self.violations += problems
            return web.json_response({"error": problems}, status=400)
        return body

    async def generate(self, request: web.Request) -> web.Response:
        body = await self.checked(request)
        if isinstance(body, web.Response):
            return body
        await self.paused.wait()
        params = body.get("sampling_params") or {}
        n, stops = params.get("max_new_tokens", 8), set(params.get("stop_token_ids") or [])
        out, finish = [], {"type": "length", "length": n}
        for _ in range(n):
            out.append((out or body["input_ids"])[-1] * 7 % VOCAB + 1)
            if out[-1] in stops:
                finish = {"type": "stop", "matched": out[-1]}
                break
        meta = {"id": body.get("rid", "r"), "finish_reason": finish, "weight_version": self.version,
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(out),
                "cached_tokens": 0, "e2e_latency": 0.001}  # fmt: skip
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in out]
        return web.json_response({"text": "", "output_ids": out, "meta_info": meta})

    async def control(self, request: web.Request) -> web.Response:
        body = await self.checked(request)
        if isinstance(body, web.Response):
            return body
        if request.path == "/pause_generation":
            self.paused.clear()
            return web.json_response({"message": "Generation paused successfully.", "status": "ok"})
        self.paused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def weights(self, request: web.Request) -> web.Response:
        body = await self.checked(request)
        if isinstance(body, web.Response):
            return body
        cmd = {"/init_weights_update_group": "init", "/update_weights_from_distributed": "update",
               "/destroy_weights_update_group": "destroy"}[request.path]  # fmt: skip
        ok, message, results = await self.ranks(cmd, body)
        if ok and cmd == "update":
            for mine, got in zip(self.received, results):
                mine.update(got)
            if body.get("weight_version") is not None:
                self.version = body["weight_version"]
        reply = {"success": ok, "message": message or "Succeeded."}
        return web.json_response(reply, status=200 if ok else 400)

    async def state(self, request: web.Request) -> web.Response:
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        return web.json_response({"argv": sys.argv[1:], "visible": env, "version": self.version,
                                  "violations": self.violations, "calls": self.calls,
                                  "received": self.received})  # fmt: skip

    def app(self) -> web.Application:
        middlewares = [api_key_middleware(self.args.api_key)] if self.args.api_key else []
        app = web.Application(client_max_size=1024**3, middlewares=middlewares)
        ok = web.Response
        app.router.add_get("/health_generate", lambda r: ok(status=200))
        app.router.add_get("/health", lambda r: ok(status=200))
        info = {"tp_size": self.args.tp_size, "model_path": self.args.model_path}
        app.router.add_get("/get_server_info", lambda r: web.json_response(info))
        app.router.add_get(
            "/get_weight_version", lambda r: web.json_response({"weight_version": self.version})
        )
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/flush_cache", lambda r: ok(status=200, text="Cache flushed.\n"))
        for path in ("/pause_generation", "/continue_generation"):
            app.router.add_post(path, self.control)
        for path in ("/init_weights_update_group", "/update_weights_from_distributed",
                     "/destroy_weights_update_group"):  # fmt: skip
            app.router.add_post(path, self.weights)
        app.router.add_get("/_fake/state", self.state)
        return app


def api_key_middleware(api_key: str):
    """SGLang's `add_api_key_middleware`: OPTIONS and /health* pass, the rest needs the key."""

    @web.middleware
    async def authentication(request: web.Request, handler):
        if request.method == "OPTIONS" or request.path.startswith(("/health", "/_fake/")):
            return await handler(request)
        if request.headers.get("Authorization") != "Bearer " + api_key:
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return authentication


def main_server() -> None:
    p = argparse.ArgumentParser("sglang.launch_server (fake)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--load-format", choices=["auto", "pt", "safetensors", "dummy"], default="auto")
    p.add_argument("--context-length", type=int)
    p.add_argument("--dtype", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    p.add_argument("--random-seed", type=int)
    p.add_argument("--api-key", type=str)
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--cuda-graph-bs", type=int, nargs="+")
    p.add_argument("--json-model-override-args", type=str, default="{}")
    for flag in ("--trust-remote-code", "--disable-radix-cache", "--skip-server-warmup"):
        p.add_argument(flag, action="store_true")
    args = p.parse_args()
    if not os.path.isdir(args.model_path):
        sys.exit(f"model path {args.model_path} is not a directory")
    web.run_app(FakeSGLang(args).app(), host=args.host, port=args.port, print=None)


def main_router() -> None:
    p = argparse.ArgumentParser("sglang_router.launch_router (fake)")
    p.add_argument("--worker-urls", nargs="+", required=True)
    p.add_argument("--policy", choices=["random", "round_robin", "cache_aware", "power_of_two"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--balance-abs-threshold", type=int)
    p.add_argument("--api-key", type=str)
    args = p.parse_args()
    turn = {"i": 0}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async def proxy(request: web.Request) -> web.Response:
        url = args.worker_urls[turn["i"] % len(args.worker_urls)]
        turn["i"] += 1
        body = await request.read()
        async with ClientSession(headers=headers) as s, s.post(url + "/generate", data=body) as r:
            return web.Response(
                status=r.status, body=await r.read(), content_type="application/json"
            )

    app = web.Application()
    app.router.add_get("/health", lambda r: web.Response(status=200))
    app.router.add_post("/generate", proxy)
    app.router.add_get("/_fake/state", lambda r: web.json_response({"argv": sys.argv[1:]}))
    web.run_app(app, host=args.host, port=args.port, print=None)

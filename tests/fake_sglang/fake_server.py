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
Per-release behaviours (`FAKE_SGLANG_VERSION`: weight-update sessions, the version dropped
while paused, the refused flush, per-token version spans) are `upstream.py`'s; requests run at
`FAKE_SGLANG_TOKEN_DELAY_S` per token, pause `in_place`/`retract` holds them mid-generation and
`abort` returns them with their partial output and `finish_reason: abort`.
With `--api-key K` every endpoint but /health* (and /_fake/state, the test's own) wants
`Authorization: Bearer K`, else 401 {"error": "Unauthorized"} -- SGLang's middleware; the fake
router's `--api-key` is what it sends to the workers, as sglang-router's.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys

from aiohttp import web
from fake_lora import FakeLora, LoraRefused, add_flags
from fake_ranks import rank_worker
from upstream import Upstream, version_spans

VOCAB = 64
NONE = type(None)
# Request structs (field -> (accepted JSON types, required)), from SGLang's io_struct.py.
SCHEMAS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "/generate": {
        "input_ids": ((list,), True), "sampling_params": ((dict, list), False),
        "return_logprob": ((bool, list), False), "logprob_start_len": ((int, list), False),
        "rid": ((str, list), False), "stream": ((bool,), False),
        "extra_key": ((str, list, NONE), False),
        "priority": ((int, NONE), False), "lora_path": ((str, NONE), False),
    },
    "/begin_weight_update": {"selector": ((str,), False)},
    "/end_weight_update": {},
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
        "selector": ((str,), False),
    },
    "/destroy_weights_update_group": {"group_name": ((str,), False)},
    "/load_lora_adapter": {
        "lora_name": ((str,), True), "lora_path": ((str,), True), "pinned": ((bool,), False),
        "lora_id": ((str, NONE), False),
    },
    "/unload_lora_adapter": {"lora_name": ((str,), True), "lora_id": ((str, NONE), False)},
    "/update_weight_version": {"new_version": ((str,), True), "abort_all_requests": ((bool,), False)},
}  # fmt: skip
# What sglang-router (0.3.2) adds to every /generate it forwards: fields of SGLang's
# GenerateReqInput, and `model`, which SGLang's HTTP layer ignores (not a field there).
SCHEMAS["/generate"] |= {
    "model": ((str, NONE), False), "return_text_in_logprobs": ((bool,), False),
    "log_metrics": ((bool,), False), "return_hidden_states": ((bool, list), False),
    "background": ((bool,), False), "no_logs": ((bool,), False),
    "return_bytes": ((bool,), False), "return_entropy": ((bool,), False),
}  # fmt: skip
if Upstream.from_env().routed_experts:  # GenerateReqInput's field from 0.5.10 on
    SCHEMAS["/generate"]["return_routed_experts"] = ((bool,), False)
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
        out += [f"/generate: {p}" for item in batch_items(body) for p in _item_problems(item)]
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


def batch_items(body: dict) -> list[dict]:
    """A /generate body as its requests: SGLang's list form (`input_ids` a list of lists; a
    list-valued field gives each item its own value, any other applies to all) or one."""
    ids = body.get("input_ids")
    if not (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        return [body]
    per_item = ("sampling_params", "return_logprob", "logprob_start_len", "rid", "extra_key")
    items = []
    for i, one in enumerate(ids):
        item = {**body, "input_ids": one}
        for key in per_item:
            if isinstance(body.get(key), list):
                item[key] = body[key][i] if i < len(body[key]) else "<missing>"
        items.append(item)
    return items


def _item_problems(item: dict) -> list[str]:
    ids, out = item.get("input_ids"), []
    if not (isinstance(ids, list) and ids and all(type(t) is int for t in ids)):
        out.append("input_ids must be a non-empty list of ints (or a list of such lists)")
    if any(
        isinstance(item.get(k), list) or item.get(k) == "<missing>"
        for k in item
        if k != "input_ids"
    ):
        out.append("a per-item list is not one value per input")
    params = item.get("sampling_params") or {}
    out += [f"unknown sampling param {k!r}" for k in params if k not in SAMPLING_KEYS]
    return out


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
        self.up = Upstream.from_env()
        self.version, self.paused = "default", asyncio.Event()
        self.paused.set()  # set = running
        self.mode: str | None = None  # the pause mode while paused
        self.reqs: dict[int, str] = {}  # in-flight request -> "running" | "waiting" (retracted)
        self.aborts = 0  # bumped by an abort: requests started before it return "abort"
        self.session = False
        self.flushes = 0
        # SGLang's radix cache, keyed as its own: extra_key + token ids (whole prompts here)
        self.cache: set[tuple] = set()
        self.cached: list[int] = []  # cached_tokens of every /generate, in order
        self.violations: list[str] = []
        self.calls: list[list] = []
        self.received: list[dict[str, str]] = [{} for _ in range(args.tp_size)]
        self.loras = FakeLora(args)  # native LoRA: adapters loaded, requests running on each

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
        await self.paused.wait()  # arrivals while paused wait in the tokenizer manager
        items = batch_items(body)
        replies = await asyncio.gather(*(self.generate_item(item) for item in items))
        refused = [r for r in replies if isinstance(r, web.Response)]
        if refused:  # SGLang fails the whole request
            return refused[0]
        return web.json_response(replies if items[0] is not body else replies[0])

    async def generate_item(self, body: dict) -> dict | web.Response:
        """One request (a batch's item or a whole body): its reply object."""
        adapter = body.get("lora_path")
        try:
            logprob = self.loras.acquire(adapter)
        except LoraRefused as e:  # SGLang's ValueError -> 400 {"error": {"message"}}
            return web.json_response({"error": {"message": str(e)}}, status=400)
        params = body.get("sampling_params") or {}
        n, stops = params.get("max_new_tokens", 8), set(params.get("stop_token_ids") or [])
        out, versions, finish = [], [], {"type": "length", "length": n}
        me, epoch = object(), self.aborts
        self.reqs[id(me)] = "running"
        try:
            for _ in range(n):
                if not await self.may_continue(me, epoch):
                    finish = {"type": "abort", "message": "Abort in waiting queue"}
                    break
                out.append((out or body["input_ids"])[-1] * 7 % VOCAB + 1)
                versions.append(self.version)
                if out[-1] in stops:
                    finish = {"type": "stop", "matched": out[-1]}
                    break
                if self.up.token_delay_s:
                    await asyncio.sleep(self.up.token_delay_s)
        finally:
            del self.reqs[id(me)]
            self.loras.release(adapter)
        key = (body.get("extra_key"), *body["input_ids"])
        cached = len(body["input_ids"]) if key in self.cache else 0
        self.cache.add(key)
        self.cached.append(cached)
        meta = {"id": body.get("rid", "r"), "finish_reason": finish, "weight_version": self.version,
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(out),
                "cached_tokens": cached, "e2e_latency": 0.001}  # fmt: skip
        if self.up.version_spans and out:
            meta["weight_versions"] = version_spans(versions)
            meta["weight_version"] = versions[-1]
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[logprob, t, None] for t in out]
        if body.get("return_routed_experts") and getattr(self.args, "enable_return_routed_experts",
                                                         False):  # fmt: skip
            meta["routed_experts"] = routed_experts(body["input_ids"] + out)
        return {"text": "", "output_ids": out, "meta_info": meta}

    async def may_continue(self, me: object, epoch: int) -> bool:
        """Between two tokens: False if aborted; held while paused in_place (still running,
        its KV kept) or retract (moved to the waiting queue)."""
        if self.aborts != epoch:
            return False
        if self.mode == "retract":
            self.reqs[id(me)] = "waiting"
        await self.paused.wait()
        self.reqs[id(me)] = "running"
        return self.aborts == epoch

    def idle(self) -> bool:
        """The scheduler's idle check behind every flush."""
        states = list(self.reqs.values())
        return "running" not in states and not (self.up.counts_waiting and states)

    async def control(self, request: web.Request) -> web.Response:
        body = await self.checked(request)
        if isinstance(body, web.Response):
            return body
        if request.path == "/pause_generation":
            self.mode = body.get("mode", "abort")
            self.paused.clear()
            if self.mode == "abort":  # as SGLang: abort everything, return once none is left
                self.aborts += 1  # each running request returns at its next token
                while self.reqs:
                    await asyncio.sleep(0.01)
            return web.json_response({"message": "Generation paused successfully.", "status": "ok"})
        self.mode = None
        self.paused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush(self, request: web.Request) -> web.Response:
        self.calls.append([request.path, {}])
        if not self.idle():
            return web.Response(status=400, text="Flush cache failed.\n")
        self.flushes += 1
        self.cache.clear()
        return web.Response(status=200, text="Cache flushed.\n")

    async def session_call(self, request: web.Request) -> web.Response:
        body = await self.checked(request)
        if isinstance(body, web.Response):
            return body
        opening = request.path == "/begin_weight_update"
        if self.session == opening:
            message = "a weight-update session is already open" if opening else "no session open"
            return web.json_response({"success": False, "message": message}, status=400)
        self.session = opening
        return web.json_response({"success": True, "message": "Success"})

    async def set_version(self, request: web.Request) -> web.Response:
        body = await self.checked(request)
        if isinstance(body, web.Response):
            return body
        if body.get("abort_all_requests", True):  # SGLang's default
            self.aborts += 1
        self.version = body["new_version"]
        return web.json_response({"success": True, "message": "ok", "new_version": self.version})

    async def weights(self, request: web.Request) -> web.Response:
        body = await self.checked(request)
        if isinstance(body, web.Response):
            return body
        cmd = {"/init_weights_update_group": "init", "/update_weights_from_distributed": "update",
               "/destroy_weights_update_group": "destroy"}[request.path]  # fmt: skip
        if cmd == "update" and self.up.session and not self.session:
            message = "update_weights_from_distributed must run between begin_weight_update()"
            return web.json_response({"success": False, "message": message}, status=400)
        ok, message, results = await self.ranks(cmd, body)
        if ok and cmd == "update":
            for mine, got in zip(self.received, results):
                mine.update(got)
            paused = not self.paused.is_set()
            if body.get("weight_version") is not None and not (
                paused and self.up.drops_paused_version
            ):
                self.version = body["weight_version"]
            if body.get("flush_cache", True) and not self.idle():
                if self.up.dies_on_refused_flush:  # assert flush_cache_success -> SIGQUIT
                    os._exit(134)
                ok, message = False, "Weights were updated, but the cache was not flushed"
            elif body.get("flush_cache", True):
                self.flushes += 1
                self.cache.clear()
        reply = {"success": ok, "message": message or "Succeeded."}
        return web.json_response(reply, status=200 if ok else 400)

    async def lora(self, request: web.Request) -> web.Response:
        """SGLang's LoRAUpdateOutput; refusals as `fake_lora.FakeLora` models them (400)."""
        body = await self.checked(request)
        if isinstance(body, web.Response):
            return body
        name, error = body["lora_name"], None
        try:
            if request.path == "/load_lora_adapter":
                self.loras.load(name, body["lora_path"])
            else:
                await self.loras.unload(name)
        except LoraRefused as e:
            error = str(e)
        reply = {"success": error is None, "error_message": error,
                 "loaded_adapters": self.adapters()}  # fmt: skip
        return web.json_response(reply, status=200 if error is None else 400)

    def adapters(self) -> dict[str, str]:
        return {name: path for name, (path, _) in self.loras.loaded.items()}

    async def state(self, request: web.Request) -> web.Response:
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        return web.json_response({"argv": sys.argv[1:], "visible": env, "version": self.version,
                                  "violations": self.violations, "calls": self.calls,
                                  "adapters": self.adapters(),
                                  "received": self.received, "flushes": self.flushes, "cached": self.cached,
                                  "in_flight": list(self.reqs.values())})  # fmt: skip

    def app(self) -> web.Application:
        middlewares = [api_key_middleware(self.args.api_key)] if self.args.api_key else []
        app = web.Application(client_max_size=1024**3, middlewares=middlewares)
        ok = web.Response
        app.router.add_get("/health_generate", lambda r: ok(status=200))
        app.router.add_get("/health", lambda r: ok(status=200))
        info = {"tp_size": self.args.tp_size, "model_path": self.args.model_path,
                "dp_size": 1, "pp_size": 1, "version": self.up.version}  # fmt: skip
        app.router.add_get("/get_server_info", lambda r: web.json_response(info))
        app.router.add_get("/server_info", lambda r: web.json_response(info))
        app.router.add_post("/update_weight_version", self.set_version)
        if self.up.session:  # the endpoints exist from 0.5.21 on
            for path in ("/begin_weight_update", "/end_weight_update"):
                app.router.add_post(path, self.session_call)
        app.router.add_get(
            "/get_weight_version", lambda r: web.json_response({"weight_version": self.version})
        )
        app.router.add_post("/generate", self.generate)
        models = self.loras.models
        app.router.add_get("/v1/models", lambda r: web.json_response(models(self.args.model_path)))
        app.router.add_post("/flush_cache", self.flush)
        for path in ("/pause_generation", "/continue_generation"):
            app.router.add_post(path, self.control)
        for path in ("/init_weights_update_group", "/update_weights_from_distributed",
                     "/destroy_weights_update_group"):  # fmt: skip
            app.router.add_post(path, self.weights)
        for path in ("/load_lora_adapter", "/unload_lora_adapter"):
            app.router.add_post(path, self.lora)
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


#: The fake's mixture of experts: (layers, top_k) of the routes it reports.
ROUTED_LAYERS, ROUTED_TOP_K = 2, 2


def routed_experts(tokens: list[int]) -> str:
    """SGLang's `meta_info["routed_experts"]`: base64 of int32 [len(tokens) - 1, layers, top_k]
    (every position but the last); expert ids derived from each token (ids 0..7)."""
    import base64
    import struct

    ids = [(t + layer + k) % 8 for t in tokens[:-1]
           for layer in range(ROUTED_LAYERS) for k in range(ROUTED_TOP_K)]  # fmt: skip
    return base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode()


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
    add_flags(p)
    if Upstream.from_env().routed_experts:  # 0.5.10+
        p.add_argument("--enable-return-routed-experts", action="store_true")
    args = p.parse_args()
    if not os.path.isdir(args.model_path):
        sys.exit(f"model path {args.model_path} is not a directory")
    web.run_app(FakeSGLang(args).app(), host=args.host, port=args.port, print=None)

"""asyncrl's own engine server: SGLang's native HTTP protocol (a subset) over a transformers LM.

    python -m asyncrl.engine.hf.server --model-path P --port N --dtype fp32|bf16 \
        [--host 127.0.0.1] [--max-batch-size B] [--seed S] [--device cpu]

Same request/response shapes as SGLang, so `asyncrl.engine.client.EngineClient` drives this
server and a real SGLang server with identical code. Token-in/token-out only: `text` is always
"" and `text` inputs are refused. Blocking work (the scheduler, pause, weight receives) runs in
threads; the aiohttp loop only parses, queues and answers. Bad input -> HTTP 400 with a one-line
JSON error in SGLang's shape; the server never dies on a request. A client that hangs up
aborts its requests. `/health_generate` runs a one-token greedy probe when idle and answers 200
without one while requests run or generation is paused (the model can generate on continue).
`/get_load` answers SGLang's per-DP-rank list (one rank here), read between steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import uuid

from aiohttp import web

from asyncrl.engine.hf.batch import RequestError, SamplingParams, Seq
from asyncrl.engine.hf.engine import PAUSE_MODES, HFEngine
from asyncrl.engine.hf.weights import WeightReceiver

log = logging.getLogger("asyncrl.engine.hf.server")
HEALTH_TIMEOUT_S = 20.0
ENGINE = web.AppKey("engine", HFEngine)
RECEIVER = web.AppKey("receiver", WeightReceiver)
INFO = web.AppKey("info", dict)
UPDATE_LOCK = web.AppKey("update_lock", asyncio.Lock)


def _error(status: int, message: str) -> web.Response:
    body = {"object": "error", "message": message, "type": str(status), "code": status}
    return web.json_response(body, status=status)


def _ok(success: bool, message: str, **extra) -> web.Response:
    body = {"success": success, "message": message, **extra}
    return web.json_response(body, status=200 if success else 400)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except (RequestError, ValueError, TypeError) as e:
        return _error(400, f"{request.path}: {type(e).__name__}: {e}".splitlines()[0])
    except Exception as e:  # never take the server down for one request
        log.exception("unhandled error on %s", request.path)
        return _error(500, f"{request.path}: internal error: {type(e).__name__}: {e}")


async def _body(request: web.Request, required: bool = True) -> dict:
    raw = await request.read()
    if not raw.strip():
        if required:
            raise RequestError("request body must be a JSON object")
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise RequestError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def _is_ids(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _per_item(value, n: int, batched: bool, name: str) -> list:
    """SGLang batch bodies may give one value for all items or a list with one per item."""
    if batched and isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


def _parse_generate(body: dict) -> tuple[list[Seq], bool]:
    if "text" in body and body["text"] is not None:
        raise RequestError("this server has no tokenizer: send input_ids, not text")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by the hf server")
    ids = body.get("input_ids")
    batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    if ids is None or not prompts or not all(_is_ids(p) and p for p in prompts):
        raise RequestError("input_ids must be a non-empty list of ints (or a list of such lists)")
    n = len(prompts)
    params = _per_item(body.get("sampling_params"), n, batched, "sampling_params")
    rids = _per_item(body.get("rid"), n, batched, "rid")
    logprob = _per_item(body.get("return_logprob", False), n, batched, "return_logprob")
    start = body.get("logprob_start_len", -1)
    if any(logprob) and start not in (-1, None):
        raise RequestError("logprob_start_len >= 0 (input logprobs) is not supported here")
    seqs = []
    for i in range(n):
        rid = rids[i] if rids[i] is not None else uuid.uuid4().hex
        sp = SamplingParams.from_json(params[i])
        seqs.append(Seq(str(rid), list(prompts[i]), sp, _noop, return_logprob=bool(logprob[i])))
    return seqs, batched


def _noop(seq: Seq) -> None:
    pass


def _reply(seq: Seq) -> dict:
    meta = {
        "id": seq.rid,
        "finish_reason": seq.finish,
        "prompt_tokens": len(seq.prompt),
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": 0,
        "weight_version": seq.weight_version,
        # asyncrl extension (SGLang reports only the version at finish): the version that
        # sampled each token, exact across in-place and retract weight updates.
        "output_token_weight_versions": list(seq.token_versions),
        "e2e_latency": time.monotonic() - seq.created,
    }
    if seq.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(seq.logprobs, seq.output_ids)
        ]
    return {"text": "", "output_ids": list(seq.output_ids), "meta_info": meta}


async def _run_seqs(engine: HFEngine, seqs: list[Seq]) -> None:
    loop = asyncio.get_running_loop()
    futs = []
    for seq in seqs:
        fut = loop.create_future()
        seq.on_done = lambda s, f=fut: loop.call_soon_threadsafe(_resolve, f, s)
        futs.append(fut)
    for seq in seqs:  # validate all before queueing any
        engine.check(seq)
    try:
        for seq in seqs:
            engine.submit(seq)
        await asyncio.gather(*futs)
    except asyncio.CancelledError:  # client went away: free the engine's slots
        for seq in seqs:
            if seq.finish is None:
                await asyncio.to_thread(engine.abort, seq.rid)
        raise


def _resolve(fut: asyncio.Future, seq: Seq) -> None:
    if not fut.done():
        fut.set_result(seq)


async def generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    seqs, batched = _parse_generate(await _body(request))
    await _run_seqs(engine, seqs)
    replies = [_reply(s) for s in seqs]
    return web.json_response(replies if batched else replies[0])


async def health_generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if not engine.alive:
        return web.Response(status=503, text="engine scheduler is not running\n")
    if engine.paused or engine.num_requests() > 0:  # busy or paused: it can generate
        return web.Response(status=200)
    probe = Seq(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], SamplingParams(1, 0.0), _noop)
    try:
        await asyncio.wait_for(_run_seqs(engine, [probe]), HEALTH_TIMEOUT_S)
    except TimeoutError:
        return web.Response(status=503, text="health probe timed out\n")
    ok = probe.finish is not None and probe.finish["type"] != "abort"
    return web.Response(status=200 if ok else 503)


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[ENGINE].alive else 503)


async def pause_generation(request: web.Request) -> web.Response:
    mode = (await _body(request, required=False)).get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise RequestError(f"unknown pause mode {mode!r}; expected one of {', '.join(PAUSE_MODES)}")
    await asyncio.shield(asyncio.to_thread(request.app[ENGINE].pause, mode))
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    request.app[ENGINE].resume()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def flush_cache(request: web.Request) -> web.Response:
    ok = await asyncio.to_thread(request.app[ENGINE].flush_cache)
    text = "Cache flushed.\n" if ok else "Cache not flushed: requests are running or waiting.\n"
    return web.Response(status=200 if ok else 400, text=text)


async def abort_request(request: web.Request) -> web.Response:
    body = await _body(request, required=False)
    rid = None if body.get("abort_all") else body.get("rid")
    if rid is None and not body.get("abort_all"):
        raise RequestError("abort_request needs rid or abort_all=true")
    await asyncio.to_thread(request.app[ENGINE].abort, None if rid is None else str(rid))
    return web.Response(status=200)


async def get_model_info(request: web.Request) -> web.Response:
    info = dict(request.app[INFO], weight_version=request.app[ENGINE].weight_version)
    return web.json_response(info)


async def get_load(request: web.Request) -> web.Response:
    load = await asyncio.to_thread(request.app[ENGINE].load)
    return web.json_response([{"dp_rank": 0, **load}])


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[ENGINE].weight_version})


async def update_weight_version(request: web.Request) -> web.Response:
    body = await _body(request)
    if "new_version" not in body:
        raise RequestError("update_weight_version needs new_version")
    engine = request.app[ENGINE]
    if body.get("abort_all_requests"):
        await asyncio.to_thread(engine.abort, None)
    engine.weight_version = str(body["new_version"])
    msg = f"Weight version updated to {engine.weight_version}"
    return _ok(True, msg, new_version=engine.weight_version)


async def _locked_in_thread(app: web.Application, fn, *args):
    """Run a group operation in a thread, one at a time, immune to client disconnects.

    Collectives on a group must run in order and to completion: a sender that gives up (and
    drops the connection, which cancels this handler) must not release the lock while the
    receive thread is still inside the collective.
    """

    async def locked():
        async with app[UPDATE_LOCK]:
            return await asyncio.to_thread(fn, *args)

    return await asyncio.shield(asyncio.ensure_future(locked()))


def _fields(body: dict, spec: dict[str, type]) -> list:
    out = []
    for key, typ in spec.items():
        if key not in body or not isinstance(body[key], typ) or isinstance(body[key], bool):
            raise RequestError(f"field {key!r} missing or not {typ.__name__}")
        out.append(body[key])
    return out


async def init_weights_update_group(request: web.Request) -> web.Response:
    body = await _body(request)
    spec = {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int}
    addr, port, offset, world = _fields(body, spec)
    name, backend = str(body.get("group_name", "weight_update_group")), body.get("backend", "nccl")
    timeout = float(body.get("timeout", request.app[INFO]["group_timeout_s"]))
    receiver = request.app[RECEIVER]
    args = (addr, port, offset, world, name, backend, timeout)
    ok, msg = await _locked_in_thread(request.app, receiver.init_group, *args)
    return _ok(ok, msg)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await _body(request)
    name = str(body.get("group_name", "weight_update_group"))
    ok, msg = await _locked_in_thread(request.app, request.app[RECEIVER].destroy_group, name)
    return _ok(ok, msg)


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    body = await _body(request)
    names, dtypes, shapes = _fields(body, {"names": list, "dtypes": list, "shapes": list})
    group = str(body.get("group_name", "weight_update_group"))
    fmt = body.get("load_format")
    receiver, engine = request.app[RECEIVER], request.app[ENGINE]
    args = (names, dtypes, shapes, group, fmt)
    ok, msg = await _locked_in_thread(request.app, receiver.update, *args)
    version = body.get("weight_version")
    if ok and version is not None:
        engine.weight_version = str(version)
        msg += f" Weight version updated to {engine.weight_version}."
    return _ok(ok, msg)


def build_app(engine: HFEngine, info: dict) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024**2)
    app[ENGINE], app[INFO] = engine, info
    app[RECEIVER] = WeightReceiver(engine)
    app[UPDATE_LOCK] = asyncio.Lock()
    r = app.router
    r.add_post("/generate", generate)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/abort_request", abort_request)
    r.add_get("/get_model_info", get_model_info)
    r.add_get("/get_load", get_load)
    r.add_get("/get_weight_version", get_weight_version)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_post("/init_weights_update_group", init_weights_update_group)
    r.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    r.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    return app


DTYPE_ALIASES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}


def load_engine(args: argparse.Namespace) -> HFEngine:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, DTYPE_ALIASES[args.dtype])
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype).to(args.device)
    engine = HFEngine(model, max_batch_size=args.max_batch_size, seed=args.seed)
    engine.weight_version = args.weight_version
    return engine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m asyncrl.engine.hf.server", description=__doc__)
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dtype", choices=sorted(DTYPE_ALIASES), default="fp32")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--group-timeout-s", type=float, default=600.0)
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    engine = load_engine(args)
    engine.start()
    info = {
        "model_path": args.model_path,
        "tokenizer_path": None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "dtype": DTYPE_ALIASES[args.dtype],
        "max_batch_size": args.max_batch_size,
        "group_timeout_s": args.group_timeout_s,
    }
    try:
        web.run_app(
            build_app(engine, info),
            host=args.host,
            port=args.port,
            print=None,
            shutdown_timeout=1.0,
            handler_cancellation=True,  # a client that hangs up aborts its requests
        )
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
    # Interpreter teardown with torch + transformers loaded takes seconds and does nothing a
    # stopped server needs; skip it so stop/restart (and the tests) are quick.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

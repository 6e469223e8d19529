"""asyncrl's own engine server: SGLang's native HTTP protocol (a subset) over a transformers LM.

    ASYNCRL_API_KEY=K python -m asyncrl.engine.hf.server --model-path P --port N \
        [--dtype fp32|bf16] [--host 127.0.0.1] [--max-batch-size B] [--seed S] [--device cpu]
        [--max-pinned-versions K] [--pinned-version-linger-s S]

Same request/response shapes as SGLang, so `asyncrl.engine.client.EngineClient` drives this
server and a real SGLang server with identical code. Token-in/token-out only: `text` is always
"" and `text` inputs are refused. Blocking work (the scheduler, pause, weight receives) runs in
threads; the aiohttp loop only parses, queues and answers. Bad input -> HTTP 400 with a one-line
JSON error in SGLang's shape (`protocol.py` checks every field); a request the engine failed
-> 500 with its error, the others go on; a dead scheduler -> 503. A client that hangs up
aborts its requests. `/health_generate` runs a one-token greedy probe when idle and answers 200
without one while requests run (and the last step went well) or generation is paused (the model
can generate on continue). `/get_load` answers SGLang's per-DP-rank list (one rank here).

Authentication as SGLang's `--api-key`: with a key, every endpoint but `/health*` wants
`Authorization: Bearer <key>` (else 401). The key comes from the environment variable
ASYNCRL_API_KEY (removed from the environment once read, never logged; the launcher passes it
so it never shows in `ps`) or from `--api-key` (visible in `ps`: for manual use).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import sys
import threading
import time
import uuid
from collections import Counter

from aiohttp import web

from asyncrl.engine.hf import routes
from asyncrl.engine.hf.batch import RequestError, SamplingParams, Seq, show
from asyncrl.engine.hf.engine import PAUSE_MODES, EngineDeadError, HFEngine
from asyncrl.engine.hf.protocol import field, ok_reply, parse_generate, read_json, version
from asyncrl.engine.hf.weight_routes import RECEIVER, add_weight_routes
from asyncrl.engine.hf.weights import WeightReceiver
from asyncrl.engine.process import API_KEY_ENV
from asyncrl.engine.versions import HF_SERVER_VERSION
from asyncrl.threads import ThreadShare, apply_thread_share

log = logging.getLogger("asyncrl.engine.hf.server")
HEALTH_TIMEOUT_S = 20.0
ENGINE = web.AppKey("engine", HFEngine)
INFO = web.AppKey("info", dict)


def _error(status: int, message: str) -> web.Response:
    message = " ".join(message.split())  # one line, whatever went into it
    message = message[:500] + ("..." if len(message) > 500 else "")
    body = {"object": "error", "message": message, "type": str(status), "code": status}
    return web.json_response(body, status=status)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except (RequestError, ValueError, TypeError) as e:
        return _error(400, f"{request.path}: {type(e).__name__}: {e}")
    except RecursionError:  # printing or parsing a deeply nested value
        return _error(400, f"{request.path}: request nested too deeply")
    except EngineDeadError as e:
        return _error(503, f"{request.path}: {e}")
    except Exception as e:  # never take the server down for one request
        log.exception("unhandled error on %s", request.path)
        return _error(500, f"{request.path}: internal error: {type(e).__name__}: {e}")


def _auth(api_key: str):
    """SGLang's rule: every endpoint but /health* (and CORS preflights) needs the bearer key."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def auth(request: web.Request, handler):
        if request.method == "OPTIONS" or request.path.startswith("/health"):
            return await handler(request)
        sent = request.headers.get("Authorization", "").encode("utf-8", "replace")
        if not hmac.compare_digest(sent, expected):
            return _error(401, "Unauthorized: send the engine's key as 'Authorization: Bearer'")
        return await handler(request)

    return auth


async def _body(request: web.Request, required: bool = True) -> dict:
    return read_json(await request.read(), required)


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
    if seq.return_routes:  # SGLang's field: base64 int32 [prompt + output - 1, layers, k]
        meta[routes.REPLY_KEY] = routes.reply_field(seq)
    return {"text": "", "output_ids": list(seq.output_ids), "meta_info": meta}


async def _run_seqs(engine: HFEngine, seqs: list[Seq]) -> None:
    """Submit `seqs` and wait until every one has finished. The loop is woken once, by the
    last to finish (64 samples finishing in one step: one wake-up, not 64 on the engine's
    thread); `on_done` runs on the scheduler thread, or here for a request finished at once."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    unfinished = {id(seq) for seq in seqs}
    lock = threading.Lock()

    def on_done(seq: Seq) -> None:
        with lock:
            if id(seq) not in unfinished:  # answered already
                return
            unfinished.remove(id(seq))
            last = not unfinished
        if last:
            loop.call_soon_threadsafe(_resolve, done)

    for seq in seqs:
        seq.on_done = on_done
    try:
        engine.submit(*seqs)  # all checked before any is queued
        await done
    except asyncio.CancelledError:  # client went away: free the engine's slots
        for seq in seqs:
            if seq.finish is None:
                await asyncio.to_thread(engine.abort, seq.rid)
        raise


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


async def generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    seqs, batched = parse_generate(await _body(request), _noop)
    await _run_seqs(engine, seqs)
    failed = [s for s in seqs if s.error is not None]
    if failed:  # the engine could not serve it (the scheduler went on with the others)
        return _error(500, f"/generate: request {failed[0].rid}: {failed[0].error}")
    replies = [_reply(s) for s in seqs]
    return web.json_response(replies if batched else replies[0])


async def health_generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if not engine.alive:
        return web.Response(status=503, text="engine scheduler is not running\n")
    if engine.paused or (engine.num_requests() > 0 and engine.last_step_ok):
        return web.Response(status=200)  # paused, or busy and stepping well: it can generate
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
    mode = field(await _body(request, required=False), "mode", str, "abort")
    if mode not in PAUSE_MODES:
        raise RequestError(f"unknown pause mode {show(mode)}; expected one of {PAUSE_MODES}")
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
    abort_all = field(body, "abort_all", bool, False)
    rid = None if abort_all else field(body, "rid", str, None)
    if rid is None and not abort_all:
        raise RequestError("abort_request needs rid or abort_all=true")
    await asyncio.to_thread(request.app[ENGINE].abort, rid)
    return web.Response(status=200)


async def get_model_info(request: web.Request) -> web.Response:
    info = dict(request.app[INFO], weight_version=request.app[ENGINE].weight_version)
    return web.json_response(info)


async def server_info(request: web.Request) -> web.Response:
    """SGLang's /server_info subset: the `version` picks the client's weight-sync steps; and
    the torch threads and cores this server runs with (asyncrl's own: the thread budget)."""
    import torch

    info = {"version": HF_SERVER_VERSION, "tp_size": 1, "dp_size": 1, "pp_size": 1}
    engine = request.app[ENGINE]  # asyncrl's own: pinned versions kept, their lease
    info["max_pinned_versions"] = engine.max_pinned_versions
    info["pinned_version_linger_s"] = engine.pinned_linger_s
    info |= {"num_threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0))}
    # what this engine was asked to do, as it did it: its pauses by mode, the weight buckets
    # it received by load_format (the fleet reports them: `EngineFleet.metrics`)
    info["pauses"] = dict(engine.pauses)
    receiver = request.app[RECEIVER]
    info["bucket_formats"] = dict(receiver.bucket_formats)
    # the dtypes its live parameters are held in (tensors per dtype): what it serves in
    info["param_dtypes"] = dict(
        Counter(str(p.dtype).removeprefix("torch.") for p in receiver.params.values())
    )
    return web.json_response(info)


async def get_load(request: web.Request) -> web.Response:
    load = await asyncio.to_thread(request.app[ENGINE].load)
    return web.json_response([{"dp_rank": 0, **load}])


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[ENGINE].weight_version})


async def update_weight_version(request: web.Request) -> web.Response:
    body = await _body(request)
    new_version = version(body, "new_version", required=True)
    engine = request.app[ENGINE]
    if field(body, "abort_all_requests", bool, False):
        await asyncio.to_thread(engine.abort, None)
    await asyncio.to_thread(engine.set_weight_version, new_version)
    msg = f"Weight version updated to {engine.weight_version}"
    return ok_reply(True, msg, new_version=engine.weight_version)


def build_app(engine: HFEngine, info: dict, api_key: str | None = None) -> web.Application:
    middlewares = [_auth(api_key), _errors] if api_key else [_errors]
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024**2)
    app[ENGINE], app[INFO] = engine, info
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
    r.add_get("/server_info", server_info)
    r.add_get("/get_server_info", server_info)
    r.add_get("/get_weight_version", get_weight_version)
    r.add_post("/update_weight_version", update_weight_version)
    add_weight_routes(app, WeightReceiver(engine), info["group_timeout_s"])
    return app


DTYPE_ALIASES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}


def load_engine(args: argparse.Namespace) -> HFEngine:
    """The engine over the model at `--model-path`: read straight from its files where the
    lean decoder serves it (`lean_model.py`: transformers' modeling code is never imported),
    else loaded with transformers."""
    import torch

    from asyncrl.engine.hf.lean_model import lean_model

    torch.manual_seed(args.seed)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, DTYPE_ALIASES[args.dtype])
    model = lean_model(args.model_path, dtype, args.device)
    if model is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype)
        model = model.to(args.device)
    engine = HFEngine(
        model,
        max_batch_size=args.max_batch_size,
        seed=args.seed,
        max_pinned_versions=args.max_pinned_versions,
        pinned_linger_s=args.pinned_version_linger_s,
    )
    engine.weight_version = args.weight_version
    return engine


def _cpu_list(text: str) -> tuple[int, ...]:
    """`--cpus 1,2`: core ids (argparse turns the ValueError into a one-line usage error)."""
    cpus = tuple(int(c) for c in text.split(",") if c.strip())
    if not cpus or min(cpus) < 0:
        raise ValueError(text)
    return cpus


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m asyncrl.engine.hf.server", description=__doc__)
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dtype", choices=sorted(DTYPE_ALIASES), default="fp32")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    # 2: an evaluation that outlasts its interval runs on beside the next one, no sync waiting
    # for it (the default run: the learner's idle at its worst step phase 4.9 -> 1.0 points
    # above the median, `asyncrl bench eval-idle`); each kept version is a copy of the weights
    p.add_argument("--max-pinned-versions", type=int, default=2, help="see engine.py")
    # A pinned version's lease: an episode's next turn is sent only once its previous turn
    # came back (an env step in between), so its version must outlive the gap (lanes.py)
    p.add_argument("--pinned-version-linger-s", type=float, default=5.0, help="see lanes.py")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--cpus", type=_cpu_list, default=(), help="pin to these cores: 1,2")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--group-timeout-s", type=float, default=600.0)
    p.add_argument("--log-level", default="WARNING")
    p.add_argument(
        "--api-key", default=None, help="shared secret (visible in ps; prefer ASYNCRL_API_KEY)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Read once and drop: nothing this process starts inherits the secret.
    api_key = os.environ.pop(API_KEY_ENV, None) or args.api_key
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    # The run's thread budget, before the engine's threads exist (they inherit the pinning).
    apply_thread_share(ThreadShare(args.num_threads, args.cpus), whole_process=True)
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
            build_app(engine, info, api_key),
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

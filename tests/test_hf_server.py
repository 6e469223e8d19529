"""The hf engine server, as a real process, driven by the real EngineClient.

One server (tiny random Qwen2, fp32) serves the whole module; the checks compare its logprobs
with a from-scratch fp32 forward of the same model, so batching/padding/KV bugs show up as
logprob mismatches.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from asyncrl.engine.client import (
    EngineClient,
    EngineTimeoutError,
    GenerateRequest,
)
from asyncrl.engine.hf.launch import launch_hf_server
from tests.helpers import random_qwen2

EOS = 1
PROMPT = [3, 4, 5]
# Requests that must still be running when a pause/flush/hang-up reaches the server are LONG
# tokens and are acted on as soon as /get_load shows MIN_TOKENS sampled: ~2000 decode steps are
# then left, while a control call acts within one step of reaching the server (the engine's
# step_lock lets it go first). So they are mid-generation by construction, not by a clock;
# where it matters the state is checked through the server. PROMPT + LONG < context (2048).
LONG = 2000
MIN_TOKENS = 4
HANG_UP_S = 2.0  # the impatient client's timeout: only has to outlast the request's admission


def make_tiny_model(path, seed: int = 0):
    return random_qwen2(path, seed=seed, eos=EOS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    return path, make_tiny_model(path)


@pytest.fixture(scope="module")
def server(tiny):
    handle = launch_hf_server(
        tiny[0], dtype="fp32", max_batch_size=4, seed=7, extra_args=["--num-threads", "1"]
    )
    yield handle
    handle.stop()


def run(coro):
    return asyncio.run(coro)


async def _with_client(url, fn):
    async with EngineClient(url, timeout=60, control_timeout=30) as c:
        return await fn(c)


async def get_load(c: EngineClient) -> dict:
    """The server's own account of its requests (SGLang's /get_load; one DP rank here)."""
    status, data = await c.http.call("GET", "/get_load")
    assert status == 200 and isinstance(data, list) and len(data) == 1, data
    return data[0]


async def wait_for_load(c, pred, what: str, task=None, timeout_s: float = 30.0) -> dict:
    """Poll /get_load until `pred(load)`; fail at the deadline, or at once if `task` ends."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = await get_load(c)
        if pred(load):
            return load
        if task is not None and task.done():
            raise AssertionError(f"the request ended before {what}: {task.result()}")
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s; /get_load: {load}"
        await asyncio.sleep(0.005)


def running_with(tokens: int):
    """One request running (not waiting) that holds at least `tokens` (prompt + output)."""
    return lambda load: (
        load["num_reqs"] - load["num_waiting_reqs"] == 1 and (load["num_tokens"] >= tokens)
    )


async def wait_mid_generation(c, task) -> dict:
    return await wait_for_load(
        c, running_with(len(PROMPT) + MIN_TOKENS), "the request ran mid-generation", task
    )


def reference_logprobs(model, prompt, output, temperature):
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    n = len(prompt)
    return [float(logp[n - 1 + j, t]) for j, t in enumerate(output)]


def assert_logprobs_match(model, prompt, completion, temperature, atol=2e-4):
    ref = reference_logprobs(model, prompt, completion.output_ids, temperature)
    assert len(completion.output_logprobs) == len(completion.output_ids)
    assert completion.output_logprobs == pytest.approx(ref, abs=atol)


def test_single_and_concurrent_generation_logprobs(server, tiny):
    model = tiny[1]
    prompts = [[3, 4, 5], [7] * 11, [9, 10], [11, 12, 13, 14, 15], [2, 3], [20] * 6, [5], [8, 9]]
    temps = [1.0, 0.7, 0.0, 1.3, 1.0, 0.5, 0.0, 2.0]
    reqs = [
        GenerateRequest(p, {"max_new_tokens": 10 + 3 * i, "temperature": t, "top_k": 20})
        for i, (p, t) in enumerate(zip(prompts, temps))
    ]
    single = run(_with_client(server.url, lambda c: c.generate_one(reqs[0])))
    assert_logprobs_match(model, prompts[0], single, temps[0])
    # 8 concurrent requests, max batch 4: rows join and leave the running batch step by step.
    outs = run(_with_client(server.url, lambda c: c.generate(reqs)))
    for p, t, r, o in zip(prompts, temps, reqs, outs):
        assert o.prompt_tokens == len(p) and o.weight_version == "default"
        if o.finish_reason == "stop":
            assert o.output_ids[-1] == EOS
        else:
            assert o.finish_reason == "length"
            assert len(o.output_ids) == r.sampling_params["max_new_tokens"]
        assert_logprobs_match(model, p, o, t)


def test_batched_body_and_stop_token(server, tiny):
    async def go(c):
        body = {
            "input_ids": [[3, 4], [5, 6, 7]],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        return await c.http.call("POST", "/generate", body)

    status, data = run(_with_client(server.url, go))
    assert status == 200 and isinstance(data, list) and len(data) == 2
    first = data[0]["output_ids"]
    meta = data[0]["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert [e[1] for e in meta["output_token_logprobs"]] == first
    assert all(e[2] is None for e in meta["output_token_logprobs"])
    # Stop on a token chosen from the greedy output: finish "stop", stop token included.
    stop_tok = first[2]
    req = GenerateRequest(
        [3, 4], {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop_tok]}
    )
    out = run(_with_client(server.url, lambda c: c.generate_one(req)))
    assert out.finish_reason == "stop" and out.output_ids == first[: first.index(stop_tok) + 1]
    assert_logprobs_match(tiny[1], [3, 4], out, 0.0)


def test_a_groups_shared_prompt_is_prefilled_once_and_each_sample_is_its_own(server, tiny):
    """A group's samples share a prompt: the engine runs it once and copies its KV to every
    row (`HFEngine._prefill`). Each row's logprobs must still match a from-scratch forward of
    its own tokens (a wrong copy would mismatch), and the rows draw independently."""
    prompts = [[3, 4, 5]] * 3 + [[9, 10]]
    params = {"max_new_tokens": 12, "temperature": 1.3, "ignore_eos": True}
    reqs = [GenerateRequest(p, params) for p in prompts]
    outs = run(_with_client(server.url, lambda c: c.generate(reqs)))
    for p, o in zip(prompts, outs):
        assert_logprobs_match(tiny[1], p, o, 1.3)
    assert len({tuple(o.output_ids) for o in outs[:3]}) > 1  # 3 draws of 12 tokens at T 1.3


def test_determinism(server, tiny):
    greedy = GenerateRequest([4, 5, 6], {"max_new_tokens": 12, "temperature": 0})
    seeded = GenerateRequest([4, 5, 6], {"max_new_tokens": 12, "sampling_seed": 123})
    a = run(_with_client(server.url, lambda c: c.generate([greedy, seeded, greedy, seeded])))
    assert a[0].output_ids == a[2].output_ids and a[1].output_ids == a[3].output_ids
    # Same server seed -> the same first sampled request, with no sampling_seed given.
    from asyncrl.engine.hf.batch import SamplingParams, Seq
    from asyncrl.engine.hf.engine import HFEngine

    outs = []
    for _ in range(2):
        engine = HFEngine(tiny[1], max_batch_size=2, seed=11)
        engine.start()
        done = threading.Event()
        seq = Seq("r", [4, 5, 6], SamplingParams(max_new_tokens=12), lambda s, d=done: d.set())
        engine.submit(seq)
        assert done.wait(30)
        engine.stop()
        outs.append(seq.output_ids)
    assert outs[0] == outs[1]


async def _pause_during(c, mode, n=LONG):
    req = GenerateRequest(PROMPT, {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True})
    task = asyncio.create_task(c.generate_one(req))
    await wait_mid_generation(c, task)
    await c.pause(mode)
    try:
        held = await get_load(c)  # the pause caught it mid-generation (abort: see its answer)
        if mode == "retract":  # back at the head of the queue, its KV dropped
            assert held == {"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 1, "num_tokens": 0}
        elif mode == "in_place":  # still in the running batch, its KV kept
            assert held["num_reqs"] == 1 and held["num_waiting_reqs"] == 0
            assert len(PROMPT) + MIN_TOKENS <= held["num_tokens"] < len(PROMPT) + n
        flushed_while_paused = await c.flush_cache()
        # ignore_eos: it runs its 3 tokens whatever it samples (a sampled EOS would end it early)
        after = GenerateRequest([6], {"max_new_tokens": 3, "ignore_eos": True})
        queued = asyncio.create_task(c.generate_one(after))
        waiting = held["num_waiting_reqs"] + 1
        paused = await wait_for_load(
            c, lambda load: load["num_waiting_reqs"] == waiting, "the new request queued", queued
        )
        await asyncio.sleep(0.2)  # a short window to see that nothing happens while paused
        assert not queued.done(), "a request ran while the engine was paused"
        assert await get_load(c) == paused, "the engine stepped while paused"
        if mode == "abort":
            out = await asyncio.wait_for(task, 5)  # aborted requests answer at once
        else:
            assert not task.done()
    finally:
        await c.resume()
    if mode != "abort":
        out = await task
    assert (await queued).finish_reason == "length"
    return out, flushed_while_paused


@pytest.mark.timing
def test_pause_abort(server, tiny):
    out, flushed = run(_with_client(server.url, lambda c: _pause_during(c, "abort")))
    assert out.finish_reason == "abort" and 0 < len(out.output_ids) < LONG
    assert flushed  # nothing running after an abort
    assert_logprobs_match(tiny[1], PROMPT, out, 1.0)


@pytest.mark.timing
@pytest.mark.parametrize("mode,flush_ok", [("retract", True), ("in_place", False)])
def test_pause_retract_and_in_place(server, tiny, mode, flush_ok):
    out, flushed = run(_with_client(server.url, lambda c: _pause_during(c, mode)))
    # retract freed the KV (flush allowed); in_place keeps it (flush refused, as SGLang)
    assert flushed is flush_ok
    assert out.finish_reason == "length" and len(out.output_ids) == LONG
    assert_logprobs_match(tiny[1], PROMPT, out, 1.0, atol=5e-4)


@pytest.mark.timing
def test_in_place_pause_stops_stepping(tiny):
    from asyncrl.engine.hf.batch import SamplingParams, Seq
    from asyncrl.engine.hf.engine import HFEngine

    engine = HFEngine(tiny[1], max_batch_size=2)
    engine.start()
    done = threading.Event()
    seq = Seq("r", [3], SamplingParams(LONG, ignore_eos=True), lambda s: done.set())
    engine.submit(seq)
    deadline = time.monotonic() + 30
    while len(seq.output_ids) < MIN_TOKENS:  # mid-generation: LONG - MIN_TOKENS steps left
        assert time.monotonic() < deadline and not done.is_set()
        time.sleep(0.001)
    engine.pause("in_place")
    n = len(seq.output_ids)
    time.sleep(0.2)  # a short window to see that no step happens while paused
    assert 0 < n == len(seq.output_ids) < LONG and not engine.flush_cache()
    engine.resume()
    deadline = time.monotonic() + 10
    while len(seq.output_ids) == n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(seq.output_ids) > n  # stepping again, from the kept KV
    engine.abort()
    assert done.wait(10) and seq.finish["type"] == "abort"
    engine.stop()


@pytest.mark.timing
def test_flush_cache_refused_while_running(server):
    async def go(c):
        req = GenerateRequest(PROMPT, {"max_new_tokens": LONG, "ignore_eos": True})
        task = asyncio.create_task(c.generate_one(req))
        await wait_mid_generation(c, task)
        during = await c.flush_cache()
        await c.pause("abort")
        await c.resume()
        out = await task  # aborted after the flush: it was running all through the flush
        return during, out.finish_reason, await c.flush_cache()

    assert run(_with_client(server.url, go)) == (False, "abort", True)


@pytest.mark.timing
def test_client_hang_up_aborts_its_request(server):
    async def go():
        async with EngineClient(server.url) as c:
            impatient = EngineClient(server.url, timeout=HANG_UP_S)
            req = GenerateRequest(PROMPT, {"max_new_tokens": LONG, "ignore_eos": True})
            task = asyncio.create_task(impatient.generate_one(req))
            await wait_mid_generation(c, task)
            # Hold it mid-generation: paused in place it can neither finish nor free its KV
            # by itself, so only the server aborting it on the hang-up lets a flush succeed.
            await c.pause("in_place")
            try:
                assert not await c.flush_cache()
                with pytest.raises(EngineTimeoutError):
                    await task  # the client gives up ...
                await impatient.close()  # ... and hangs up
                deadline = time.monotonic() + 10
                while not await c.flush_cache():  # the server notices and aborts
                    if time.monotonic() > deadline:
                        return False
                    await asyncio.sleep(0.01)
                return True
            finally:
                await impatient.close()
                await c.resume()

    assert run(go())


BAD_BODIES = [
    ("/generate", b"{not json"),
    ("/generate", b"[1, 2]"),
    ("/generate", {}),
    ("/generate", {"input_ids": "abc"}),
    ("/generate", {"input_ids": []}),
    ("/generate", {"input_ids": [1, "x"]}),
    ("/generate", {"input_ids": [999]}),
    ("/generate", {"text": "hello"}),
    ("/generate", {"input_ids": [1], "stream": True}),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": -1}}),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}),
    ("/generate", {"input_ids": [1], "sampling_params": {"bogus": 1}}),
    ("/generate", {"input_ids": [1], "sampling_params": {"n": 4}}),
    ("/generate", {"input_ids": [1], "return_logprob": True, "logprob_start_len": 0}),
    ("/pause_generation", {"mode": "sideways"}),
    ("/update_weights_from_distributed", {"names": ["a"]}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1"}),
    ("/update_weight_version", {}),
    ("/abort_request", {}),
    # issue 14: these were 500s or accepted (the version "v1" broke every later reply)
    ("/generate", b"[" * 100_000 + b"]" * 100_000),
    ("/generate", b'{"input_ids": [1], "rid": ' + b"[" * 900 + b"]" * 900 + b"}"),
    ("/generate", {"input_ids": [1], "sampling_params": {"sampling_seed": 2**70}}),
    ("/generate", {"input_ids": [1], "bogus_field": 1}),
    ("/update_weight_version", {"new_version": {"a": 1}}),
    ("/update_weight_version", {"new_version": "x" * 1000}),
    ("/update_weight_version", {"new_version": "v1"}),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": [], "shapes": [], "weight_version": [1]}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 10**30, "rank_offset": 1, "world_size": 2}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 0, "world_size": 2}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 2, "timeout": 1e300}),
    ("/abort_request", {"rid": {"a": 1}}),
]  # fmt: skip


@pytest.mark.parametrize(
    "path,body", BAD_BODIES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_BODIES)]
)
def test_malformed_requests_get_400(server, path, body):
    import json
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400
    reply = json.loads(err.value.read())
    assert reply["code"] == 400 and "\n" not in reply["message"] and reply["message"]
    assert len(reply["message"]) <= 503  # one short line, whatever was sent
    assert run(_with_client(server.url, lambda c: c.health()))


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/update_weight_version", {"new_version": {"a": 1}}, "new_version"),
        ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": {}}, "shapes"),
        ("/init_weights_update_group", {"master_address": 1}, "master_address"),
        ("/pause_generation", {"mode": ["abort"]}, "mode"),
        ("/generate", {"input_ids": [1], "rid": 5}, "rid"),
        ("/generate", {"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
        ("/generate", {"input_ids": [1], "top_logprobs_num": 5}, "top_logprobs_num"),
        ("/generate", {"input_ids": [1], "extra_key": 5}, "extra_key"),
    ],
)
def test_a_bad_field_is_named(server, path, body, field):
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode())
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400 and field in json.loads(err.value.read())["message"]


def test_info_and_weight_version_endpoints(server):
    async def go(c):
        status, info = await c.http.call("GET", "/get_model_info")
        assert status == 200 and info["is_generation"] and "weight_version" in info
        assert (await c.http.call("GET", "/server_info"))[1]["version"] == "asyncrl-hf"
        await c.update_weight_version(41)
        assert (await c.http.call("GET", "/get_weight_version"))[1] == {"weight_version": "41"}
        out = await c.generate_one(GenerateRequest([3], {"max_new_tokens": 2}))
        assert out.weight_version == "41" and out.version == 41
        await c.update_weight_version("default")
        return await c.http.call("GET", "/health")

    assert run(_with_client(server.url, go))[0] == 200


def test_server_info_counts_pauses_by_mode_and_names_the_weights_dtype(server):
    async def go(c):
        before = (await c.server_info())["pauses"]
        for mode in ("retract", "in_place", "retract"):
            await c.pause(mode)
            await c.resume()
        return before, await c.server_info()

    before, info = run(_with_client(server.url, go))
    added = {m: n - before.get(m, 0) for m, n in info["pauses"].items()}
    assert {m: n for m, n in added.items() if n} == {"retract": 2, "in_place": 1}
    assert set(info["param_dtypes"]) == {"float32"}  # the server runs fp32

"""EngineClient against a tiny in-process aiohttp fake engine that answers what we tell it to.

Only the engine is fake; the client (HTTP, timeouts, reply checks) is the real one.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from asyncrl.engine.client import (
    EngineClient,
    EngineError,
    EngineReplyError,
    EngineTimeoutError,
    GenerateRequest,
)
from asyncrl.engine.replies import generate_body
from asyncrl.net import free_port

GOOD = {
    "text": "",
    "output_ids": [5, 6, 1],
    "meta_info": {
        "id": "r1",
        "finish_reason": {"type": "stop", "matched": 1},
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "weight_version": "7",
        "output_token_logprobs": [[-0.5, 5, None], [-1.0, 6, None], [-0.1, 1, None]],
    },
}


def variant(**changes) -> dict:
    """GOOD with meta_info keys replaced (None value: key removed)."""
    meta = dict(GOOD["meta_info"])
    for key, value in changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    return {**GOOD, "meta_info": meta}


class FakeEngine:
    """Serves `self.reply` (a dict, or raw text) on every endpoint with `self.status`."""

    def __init__(self) -> None:
        self.reply: object = GOOD
        self.status = 200
        self.delay = 0.0
        self.server_version = "0.5.23"
        self.bodies: list[tuple[str, object]] = []
        self.auth: list[str | None] = []  # the Authorization header of every request

    async def handle(self, request: web.Request) -> web.Response:
        if request.path in ("/server_info", "/get_server_info"):  # the client asks once
            return web.json_response({"version": self.server_version})
        body = await request.json() if request.can_read_body else None
        self.bodies.append((request.path, body))
        self.auth.append(request.headers.get("Authorization"))
        await asyncio.sleep(self.delay)
        if isinstance(self.reply, str):
            return web.Response(text=self.reply, status=self.status)
        return web.json_response(self.reply, status=self.status)


async def with_fake(test):
    fake = FakeEngine()
    app = web.Application()
    app.router.add_route("*", "/{path:.*}", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    client = EngineClient(f"http://127.0.0.1:{port}", timeout=1, control_timeout=1)
    try:
        await test(fake, client)
    finally:
        await client.close()
        await runner.cleanup()


REQ = GenerateRequest([3, 4], {"max_new_tokens": 3})


def test_good_reply_parses_and_request_shape():
    async def test(fake, client):
        out = await client.generate_one(REQ)
        assert out.output_ids == [5, 6, 1] and out.output_logprobs == [-0.5, -1.0, -0.1]
        assert (out.finish_reason, out.weight_version, out.version) == ("stop", "7", 7)
        assert out.prompt_tokens == 2 and out.token_versions() == [7, 7, 7]
        path, body = fake.bodies[-1]
        assert path == "/generate" and body["input_ids"] == [3, 4]
        assert body["return_logprob"] is True and body["logprob_start_len"] == -1

    asyncio.run(with_fake(test))


def test_a_group_is_one_batched_request_in_sglangs_list_form():
    async def test(fake, client):
        fake.reply = [GOOD, variant(weight_version="8")]
        as_dict = {"input_ids": [3], "sampling_params": {"sampling_seed": 1}, "rid": "a"}
        outs = await client.generate([as_dict, REQ])
        assert [o.version for o in outs] == [7, 8] and client.seen_version == 8
        assert outs[0].output_ids == [5, 6, 1] and outs[1].token_versions() == [8, 8, 8]
        path, body = fake.bodies[0]
        assert path == "/generate" and body["input_ids"] == [[3], [3, 4]]
        assert body["sampling_params"] == [{"sampling_seed": 1}, {"max_new_tokens": 3}]
        assert body["return_logprob"] == [True, True] and body["logprob_start_len"] == -1
        assert body["rid"][0] == "a" and len(body["rid"]) == 2  # one per item, or none
        assert body["extra_key"] == "asyncrl-w0"  # one string per body (see below)
        assert await client.generate([]) == [] and len(fake.bodies) == 1  # nothing sent

    asyncio.run(with_fake(test))


def test_a_batched_body_carries_one_extra_key_string_split_by_request_namespace():
    """SGLang before 0.5.15 hands each item of a batch the whole `extra_key` list, which its
    radix cache cannot hash: a batched body carries one string, so requests with namespaces of
    their own go in one body per namespace, and each caller gets its replies in order."""

    async def test(fake, client):
        fake.reply = [GOOD, GOOD]
        reqs = [
            GenerateRequest([1], extra_key="x"),
            GenerateRequest([2]),
            GenerateRequest([3], extra_key="x"),
            GenerateRequest([4]),
        ]
        outs = await client.generate(reqs)
        assert len(outs) == 4 and len(fake.bodies) == 2
        bodies = {b["extra_key"]: b["input_ids"] for _, b in fake.bodies}
        assert bodies == {"x": [[1], [3]], "asyncrl-w0": [[2], [4]]}

    asyncio.run(with_fake(test))


def test_generate_body_is_the_exact_body_and_refuses_mixed_namespaces():
    reqs = [GenerateRequest([1], {"temperature": 0.5}, rid="a"), GenerateRequest([2])]
    body = generate_body(reqs, True, "asyncrl-w3", "asyncrl-v3", {"priority": 2})
    assert body == {
        "input_ids": [[1], [2]],
        "sampling_params": [{"temperature": 0.5}, {}],
        "return_logprob": [True, True],
        "logprob_start_len": -1,
        "rid": ["a", body["rid"][1]],
        "priority": 2,
        "extra_key": "asyncrl-w3",
        "lora_path": "asyncrl-v3",
    }
    single = generate_body(reqs[1:], False, "asyncrl-w0")
    assert single == {
        "input_ids": [2], "sampling_params": {}, "return_logprob": True,
        "logprob_start_len": -1, "extra_key": "asyncrl-w0",
    }  # fmt: skip
    with pytest.raises(ValueError, match="several extra_keys"):
        generate_body([reqs[0], GenerateRequest([3], extra_key="x")], True, "asyncrl-w0")
    with pytest.raises(ValueError, match="single /generate of 2"):
        generate_body(reqs, False, "asyncrl-w0")


def test_through_a_router_a_group_is_one_single_form_request_per_sample():
    """sglang-router's /generate takes only the single form: a client made with router=True
    sends each request alone (concurrently), with its keys; replies come back in order."""

    async def test(fake, _client):
        async with EngineClient(_client.url, timeout=3, router=True) as client:
            reqs = [GenerateRequest([i], {"sampling_seed": i}) for i in range(3)]
            outs = await asyncio.gather(client.generate(reqs, priority=5), client.generate([]))
            assert [len(o) for o in outs] == [3, 0] and len(fake.bodies) == 3
            bodies = sorted((b for _, b in fake.bodies), key=lambda b: b["input_ids"])
            for i, body in enumerate(bodies):
                assert body["input_ids"] == [i] and body["sampling_params"] == {"sampling_seed": i}
                assert body["return_logprob"] is True and body["priority"] == 5
                assert body["extra_key"] == "asyncrl-w0"
            fake.status, fake.delay = 500, 0.2
            with pytest.raises(EngineError, match="HTTP 500"):
                await client.generate(reqs)

    asyncio.run(with_fake(test))


@pytest.mark.parametrize("reply", [[GOOD], GOOD, [GOOD, GOOD, GOOD]])
def test_a_batch_reply_of_another_length_is_refused_in_one_line(reply):
    async def test(fake, client):
        fake.reply = reply
        with pytest.raises(EngineReplyError, match="for a batch of 2") as e:
            await client.generate([REQ, REQ])
        assert "\n" not in str(e.value)

    asyncio.run(with_fake(test))


# What a buggy engine might emit: a bare NaN literal (Python's json accepts it).
NAN_REPLY = json.dumps(
    variant(output_token_logprobs=[[-0.5, 5, None], ["NaN", 6, None], [-0.1, 1, None]])
).replace('"NaN"', "NaN")

MALFORMED = [
    ("missing meta_info", {"output_ids": [5]}, "missing meta_info"),
    (
        "count mismatch",
        variant(output_token_logprobs=[[-0.5, 5, None]]),
        "1 output_token_logprobs for 3",
    ),
    ("nan logprob", NAN_REPLY, "non-finite"),
    (
        "inf logprob",
        variant(output_token_logprobs=[[-0.5, 5, None], [float("-inf"), 6, None], [-0.1, 1, None]]),
        "non-finite",
    ),
    (
        "token mismatch",
        variant(output_token_logprobs=[[-0.5, 5, None], [-1.0, 9, None], [-0.1, 1, None]]),
        "for token 9",
    ),
    ("no logprobs", variant(output_token_logprobs=None), "output_token_logprobs is missing"),
    ("bad finish", variant(finish_reason={"type": "done"}), "finish_reason"),
    ("no version", variant(weight_version=None), "weight_version"),
    ("not an object", [1, 2, 3], "expected an object"),
    ("bad output ids", {**GOOD, "output_ids": "abc"}, "output_ids"),
]


@pytest.mark.parametrize("reply,problem", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_replies_raise_engine_reply_error(reply, problem):
    async def test(fake, client):
        fake.reply = reply
        with pytest.raises(EngineReplyError, match=problem) as err:
            await client.generate_one(REQ)
        assert client.url in str(err.value)

    asyncio.run(with_fake(test))


@pytest.mark.timing
def test_http_errors_timeouts_and_down_engines():
    async def test(fake, client):
        fake.status, fake.reply = 500, {"object": "error", "message": "boom"}
        with pytest.raises(EngineError, match="HTTP 500: boom"):
            await client.generate_one(REQ)
        fake.status, fake.reply = 200, "not json at all"
        with pytest.raises(EngineReplyError, match="expected an object"):
            await client.generate_one(REQ)
        fake.reply, fake.delay = GOOD, 1.5
        with pytest.raises(EngineTimeoutError, match="no reply within 1s"):
            await client.generate_one(REQ)
        assert not await client.health()  # times out -> False, never raises
        fake.delay = 0.0
        assert await client.health()

    asyncio.run(with_fake(test))
    down = EngineClient(f"http://127.0.0.1:{free_port()}", control_timeout=2)

    async def go():
        with pytest.raises(EngineError, match=down.url):
            await down.pause("abort")
        assert not await down.health()
        await down.close()

    asyncio.run(go())


def test_generation_is_bounded_by_timeout_and_control_calls_by_control_timeout():
    async def test(fake, _client):
        client = EngineClient(_client.url, timeout=3, control_timeout=0.5)
        fake.delay = 1.0  # longer than a control call may take, well within a generation's
        try:
            assert (await client.generate_one(REQ)).output_ids == [5, 6, 1]
            fake.reply = [GOOD]
            assert len(await client.generate([REQ])) == 1
            with pytest.raises(EngineTimeoutError, match="flush_cache gave no reply within"):
                await client.flush_cache()
        finally:
            await client.close()

    asyncio.run(with_fake(test))


def test_control_calls_and_success_flags():
    async def test(fake, client):
        fake.reply = {"message": "Generation paused successfully.", "status": "ok"}
        await client.pause("retract")
        assert fake.bodies[-1] == ("/pause_generation", {"mode": "retract"})
        await client.resume()
        fake.reply = {"success": True, "message": "ok"}
        await client.init_weights_update_group("127.0.0.1", 1234, 1, 2, "g", "gloo")
        assert fake.bodies[-1][1] == {
            "master_address": "127.0.0.1",
            "master_port": 1234,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "g",
            "backend": "gloo",
        }
        await client.update_weights(["w"], ["bfloat16"], [[2, 3]], 4, "flattened_bucket", "g")
        body = fake.bodies[-1][1]
        assert body["weight_version"] == "4" and body["load_format"] == "flattened_bucket"
        fake.status, fake.reply = 400, {"success": False, "message": "shape mismatch\nfor w"}
        with pytest.raises(EngineError, match="shape mismatch for w"):
            await client.update_weights(["w"], ["float32"], [[2]])
        fake.reply = {"message": "no success key"}
        with pytest.raises(EngineReplyError, match="lacks success"):
            await client.update_weights(["w"], ["float32"], [[2]])
        fake.reply = "Cache not flushed"
        assert await client.flush_cache() is False
        fake.status = 200
        assert await client.flush_cache() is True

    asyncio.run(with_fake(test))


def test_per_token_versions_extension_is_parsed_and_checked():
    from asyncrl.engine.client import EngineReplyError, parse_completion

    meta = {
        "finish_reason": {"type": "length"},
        "weight_version": "3",
        "prompt_tokens": 2,
        "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
    }
    reply = {"output_ids": [5, 6], "meta_info": meta}
    assert parse_completion("u", reply, True).token_versions() == [3, 3]  # SGLang: per request
    meta["output_token_weight_versions"] = ["default", "3"]
    assert parse_completion("u", reply, True).token_versions() == [0, 3]
    meta["output_token_weight_versions"] = ["3"]
    with pytest.raises(EngineReplyError, match="one version per output token"):
        parse_completion("u", reply, True)
    meta["output_token_weight_versions"] = ["x", "3"]
    with pytest.raises(EngineReplyError, match="non-integer"):
        parse_completion("u", reply, True)


def test_api_key_is_sent_as_a_bearer_header_on_every_call():
    async def test(fake, client):
        await client.generate_one(REQ)
        assert fake.auth == [None]  # no key: no header
        keyed = EngineClient(client.url, control_timeout=1, api_key="s3cret")
        try:
            await keyed.generate_one(REQ)
            await keyed.pause("abort")
            assert await keyed.health()
            assert fake.auth[1:] == ["Bearer s3cret"] * 3
            assert "s3cret" not in repr(keyed)
        finally:
            await keyed.close()

    asyncio.run(with_fake(test))


def test_health_takes_its_own_timeout():
    async def test(fake, client):
        fake.delay = 0.5
        assert not await client.health(timeout_s=0.1)  # a hung engine: False, in bounded time
        assert await client.health(timeout_s=5)

    asyncio.run(with_fake(test))

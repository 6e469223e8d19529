"""Weight sync: the real WeightSender against a real hf server process over gloo.

Only the stalled/absent engines are faked (an aiohttp endpoint that never answers, a port
with nobody behind it, a server frozen with SIGSTOP); the sender and server stay real.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest
import torch
from aiohttp import web

from asyncrl.engine.client import EngineClient, GenerateRequest
from asyncrl.engine.hf.launch import launch_hf_server
from asyncrl.net import free_port
from asyncrl.weights.buckets import (
    BucketLayoutError,
    StagingBuffer,
    bucketize,
    flat_layout,
    flatten_bucket,
    unflatten_bucket,
)
from asyncrl.weights.sync import WeightSender, WeightSyncError
from tests.helpers import random_qwen2

GROUP_TIMEOUT = 4.0


def make_tiny_model(path=None, seed: int = 0):
    return random_qwen2(path, seed=seed, eos=1, init_std=0.3)


# ---- pure functions ----------------------------------------------------------------------------
def test_bucketize_keeps_order_and_bounds():
    sizes = [10, 30, 5, 100, 20, 20, 1]  # float32 elements
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    buckets = list(bucketize(named, bucket_bytes=160))
    flat = [name for b in buckets for name, _ in b]
    assert flat == [n for n, _ in named]  # order preserved, nothing lost
    assert [[n for n, _ in b] for b in buckets] == [
        ["t0", "t1"],  # 40 + 120 = 160 bytes: exactly full
        ["t2"],
        ["t3"],  # 400 bytes > 160: alone
        ["t4", "t5"],
        ["t6"],
    ]
    for b in buckets:  # within the limit, unless one tensor alone is bigger
        assert len(b) == 1 or sum(t.numel() * 4 for _, t in b) <= 160
    assert list(bucketize([], 10)) == []
    with pytest.raises(ValueError):
        list(bucketize(named, 0))


def test_flattened_layout_aligns_and_round_trips():
    tensors = [
        torch.arange(3, dtype=torch.uint8),
        torch.randn(2, 3),
        torch.randn(5).to(torch.bfloat16),
        torch.tensor([7], dtype=torch.int64),
        torch.randn(3).half(),
    ]
    offsets, total = flat_layout([t.dtype for t in tensors], [t.shape for t in tensors])
    assert offsets == [0, 4, 28, 40, 48] and total == 54
    assert all(off % t.element_size() == 0 for off, t in zip(offsets, tensors))
    buf = flatten_bucket(tensors)
    assert buf.dtype == torch.uint8 and buf.numel() == total
    back = unflatten_bucket(buf, [t.dtype for t in tensors], [t.shape for t in tensors])
    for a, b in zip(tensors, back):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_flatten_into_a_reused_staging_buffer_matches_a_fresh_one():
    tensors = [torch.arange(3, dtype=torch.uint8), torch.randn(2, 3), torch.randn(5).half()]
    staging = StagingBuffer()
    _, total = flat_layout([t.dtype for t in tensors], [t.shape for t in tensors])
    dirty = staging.get(total + 16, torch.device("cpu")).fill_(0xFF)  # garbage in the gaps
    packed = flatten_bucket(tensors, staging.get(total, torch.device("cpu")))
    assert packed.data_ptr() == dirty.data_ptr()  # reused, not reallocated
    assert torch.equal(packed, flatten_bucket(tensors))  # alignment gaps zeroed, same bytes
    bigger = staging.get(total + 64, torch.device("cpu"))
    assert bigger.numel() == total + 64  # grown on demand
    with pytest.raises(BucketLayoutError, match="staging buffer"):
        flatten_bucket(tensors, torch.empty(total - 1, dtype=torch.uint8))
    staging.release()
    assert staging.get(4, torch.device("cpu")).numel() == 4


def test_staging_buffer_keeps_host_memory_across_syncs():
    staging = StagingBuffer()
    first = staging.get(64, torch.device("cpu"))
    staging.finish()  # end of a sync: a host buffer stays for the next one
    assert staging.get(32, torch.device("cpu")).data_ptr() == first.data_ptr()


def test_auto_load_format_flattens_small_tensors_and_sends_large_ones_alone():
    from asyncrl.weights.buckets import PER_TENSOR_MIN_BYTES, bucket_format

    small = [("norm", torch.zeros(64)), ("bias", torch.zeros(128))]
    large = [("w", torch.zeros(PER_TENSOR_MIN_BYTES // 2)), ("norm", torch.zeros(4))]  # 2 MiB
    assert bucket_format(small) == "flattened_bucket"
    assert bucket_format(large) is None  # average over 1 MiB: straight into the parameters


# ---- against a real server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model(path, seed=0)
    args = ["--num-threads", "1", "--group-timeout-s", str(GROUP_TIMEOUT)]
    handle = launch_hf_server(path, dtype="fp32", max_batch_size=4, extra_args=args)
    yield handle
    if handle.proc.poll() is None:
        os.kill(handle.proc.pid, signal.SIGCONT)
    handle.stop()


PROMPT = [3, 4, 5, 6]


async def greedy_matches(client: EngineClient, model) -> str:
    """Generate greedily; assert the logprobs are those of `model`. Returns weight_version."""
    req = GenerateRequest(PROMPT, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    out = await client.generate_one(req)
    ids = torch.tensor([PROMPT + out.output_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    ref = [float(logp[len(PROMPT) - 1 + j, t]) for j, t in enumerate(out.output_ids)]
    assert out.output_ids == [int(logp[len(PROMPT) - 1 + j].argmax()) for j in range(8)]
    assert out.output_logprobs == pytest.approx(ref, abs=1e-4)
    return out.weight_version


def test_sync_plain_and_flattened_updates_weights_and_version(server):
    async def go():
        async with EngineClient(server.url, timeout=30) as client:
            sender = WeightSender(group_name="sync_test", timeout_s=GROUP_TIMEOUT)
            await sender.init_group([client], backend="gloo")
            for version, fmt in [(1, None), (2, "flattened_bucket"), (3, "auto")]:
                model = make_tiny_model(seed=version)
                stats = await sender.sync(
                    model.named_parameters(), version, bucket_bytes=16_000, load_format=fmt
                )
                nbytes = sum(p.numel() * 4 for p in model.parameters())
                assert stats.buckets > 1 and stats.tensors == len(list(model.parameters()))
                assert stats.bytes >= nbytes and stats.version == version
                assert await greedy_matches(client, model) == str(version)
            # a bad bucket is refused whole and leaves the model as it was
            with pytest.raises(WeightSyncError, match=server.url):
                await sender.sync([("model.nope.weight", torch.zeros(3))], version=4)
            bad_shape = [("lm_head.weight", torch.zeros(2, 2))]
            with pytest.raises(WeightSyncError, match="shape mismatch"):
                await sender.sync(bad_shape, version=5, load_format=None)
            await client.resume()  # a failed sync leaves engines paused on purpose
            assert await greedy_matches(client, model) == "3"
            await sender.close()

    asyncio.run(go())


def test_init_names_an_engine_that_never_joins(server):
    async def go():
        release = asyncio.Event()

        async def hang(request):  # answers only when the test is over
            await release.wait()
            return web.json_response({"success": False, "message": "released"})

        app = web.Application()
        app.router.add_post("/init_weights_update_group", hang)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        fake = EngineClient(f"http://127.0.0.1:{port}")
        real = EngineClient(server.url)
        gone = EngineClient(f"http://127.0.0.1:{free_port()}")  # nobody listening
        sender = WeightSender(group_name="init_stall", timeout_s=2.0)
        t0 = time.monotonic()
        try:
            with pytest.raises(WeightSyncError, match=f"127.0.0.1:{port}") as err:
                await sender.init_group([real, fake], backend="gloo")
            assert server.url not in str(err.value).split("never joined")[-1]
            assert time.monotonic() - t0 < 15
            with pytest.raises(WeightSyncError, match=gone.url):
                await WeightSender(timeout_s=2.0).init_group([gone], backend="gloo")
        finally:
            release.set()
            for c in (fake, real, gone):
                await c.close()
            await runner.cleanup()

    asyncio.run(go())


def test_non_finite_and_mistyped_tensors_are_refused_model_unchanged(server):
    """NaN/inf would poison every later sample and a silent cast hides a sender bug: the bucket
    is refused naming the tensor, the model and its version stay as they were."""
    good = make_tiny_model(seed=21)
    name, shape = "lm_head.weight", tuple(good.lm_head.weight.shape)

    async def go():
        async with EngineClient(server.url, timeout=30) as client:
            sender = WeightSender(group_name="refuse", timeout_s=GROUP_TIMEOUT)
            await sender.init_group([client], backend="gloo")
            await sender.sync(good.named_parameters(), 8)
            nan = torch.zeros(shape)
            nan[0, 0] = float("nan")
            inf = torch.full(shape, float("inf"))
            # a whole model's bucket, one tensor in its middle broken: summed whole first, the
            # engine still names the tensor
            whole = [(n, p.detach().clone()) for n, p in good.named_parameters()]
            middle = whole[len(whole) // 2][0]
            whole[len(whole) // 2][1].view(-1)[-1] = float("nan")
            bad = [
                ([(name, nan)], None, "non-finite values .*lm_head.weight"),
                ([(name, inf)], "flattened_bucket", "non-finite values .*lm_head.weight"),
                (whole, "flattened_bucket", f"non-finite values .*'{re.escape(middle)}'"),
                ([(name, torch.zeros(shape, dtype=torch.int64))], None, "dtype mismatch for "
                 "'lm_head.weight': sent int64, model has float32"),
                ([(name, torch.zeros(shape, dtype=torch.float16))], "flattened_bucket",
                 "dtype mismatch for 'lm_head.weight': sent float16"),
            ]  # fmt: skip
            for version, (named, fmt, problem) in enumerate(bad, start=9):
                with pytest.raises(WeightSyncError, match=problem):
                    await sender.sync(named, version, load_format=fmt, pause_mode=None)
                assert await greedy_matches(client, good) == "8"  # model and version unchanged
            await sender.close()

    asyncio.run(go())


def test_a_control_call_that_fails_says_what_happened(tmp_path):
    """A stopped engine: the pause times out, and the error says so (it used to end in ': ').
    Its own server: the timed-out pause still lands once the process runs again."""
    make_tiny_model(tmp_path, seed=0)
    handle = launch_hf_server(tmp_path, extra_args=["--num-threads", "1"])

    async def go():
        async with EngineClient(handle.url, timeout=30, control_timeout=30) as client:
            sender = WeightSender(group_name="control", timeout_s=2.0)
            await sender.init_group([client], backend="gloo", timeout_s=60)
            os.kill(handle.proc.pid, signal.SIGSTOP)
            with pytest.raises(WeightSyncError) as err:
                await sender.sync(make_tiny_model().named_parameters(), 1, pause_mode="in_place")
            handle.kill()
            await sender.close()  # the engine is gone: only our side of the group is left
            return str(err.value)

    try:
        message = asyncio.run(go())
    finally:
        handle.kill()
    assert message == f"pause(in_place) failed on engine {handle.url}: no reply within 2s"


@pytest.mark.timing
def test_stalled_engine_during_sync_is_named_then_group_recovers(server):
    model = make_tiny_model(seed=9)

    async def go():
        async with EngineClient(server.url, timeout=30, control_timeout=30) as client:
            sender = WeightSender(group_name="stall", timeout_s=GROUP_TIMEOUT)
            await sender.init_group([client], backend="gloo")
            os.kill(server.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                with pytest.raises(WeightSyncError, match=server.url):
                    await sender.sync(model.named_parameters(), 5, pause_mode=None)
                assert time.monotonic() - t0 < GROUP_TIMEOUT + 8
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            with pytest.raises(WeightSyncError, match="broken"):
                await sender.sync(model.named_parameters(), 5)
            await sender.init_group([client], backend="gloo")  # a fresh group works again
            await sender.sync(model.named_parameters(), 6)
            assert await greedy_matches(client, model) == "6"
            await sender.close()

    asyncio.run(go())


async def wait_mid_generation(client: EngineClient, task: asyncio.Task, tokens: int) -> None:
    """Poll SGLang's /get_load (deadline, no fixed sleep) until one request runs holding at
    least `tokens` (prompt + output); fail at once if `task` (that request) ends first."""
    deadline = time.monotonic() + 30
    while True:
        status, data = await client.http.call("GET", "/get_load")
        assert status == 200 and isinstance(data, list) and len(data) == 1, data
        load = data[0]
        running = load["num_reqs"] - load["num_waiting_reqs"]
        if running == 1 and load["num_tokens"] >= tokens:
            return
        if task.done():
            raise AssertionError(f"the request ended before it was seen running: {task.result()}")
        assert time.monotonic() < deadline, f"request not seen running; /get_load: {load}"
        await asyncio.sleep(0.005)


@pytest.mark.timing
@pytest.mark.parametrize("pause_mode", ["in_place", None])
def test_in_place_update_mid_generation_stamps_each_token_with_its_version(server, pause_mode):
    """A weight update lands while a long request runs (pause in_place; or none, in several
    buckets, loaded at the last): tokens sampled before carry the old version, tokens after
    the new one, and the request finishes normally."""
    model = make_tiny_model(seed=11)
    target = 7 if pause_mode else 8  # above what the last test (module server) left
    # The sync starts once a few tokens are sampled; ~2000 decode steps are then left, while
    # its pause acts within one step of reaching the server: the update lands mid-generation
    # by construction (the versions asserted below show it did). PROMPT + n < context 2048.
    n = 2000

    async def go():
        async with EngineClient(server.url, timeout=60) as client:
            sender = WeightSender(group_name="inplace", timeout_s=GROUP_TIMEOUT)
            await sender.init_group([client], backend="gloo")
            params = {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}
            task = asyncio.create_task(client.generate_one(GenerateRequest(PROMPT, params)))
            await wait_mid_generation(client, task, len(PROMPT) + 4)
            await sender.sync(
                model.named_parameters(), target, bucket_bytes=16_000, pause_mode=pause_mode
            )
            out = await task
            await sender.close()
        versions = out.token_versions()
        assert out.finish_reason == "length" and len(versions) == n
        assert versions == sorted(versions) and versions[-1] == target and versions[0] < target
        assert out.version == target

    asyncio.run(go())


def test_an_unpaused_engine_holds_every_bucket_until_the_last(server):
    """pause_mode none: while the buckets arrive the engine keeps serving the old weights under
    the old version (a request answered between two buckets shows both); the bucket carrying
    the version loads them all at once. A bucket refused mid-sync drops the ones held."""
    import threading

    old, new = make_tiny_model(seed=21), make_tiny_model(seed=22)
    seen: list[str] = []

    def probing(named, at: int):
        """`named`, answering one greedy request (checked against `old`) before tensor `at`
        is handed over: by then the buckets before it were sent and acknowledged."""
        for i, item in enumerate(named):
            if i == at:  # a request of its own loop, in a thread: this one is the sender's
                box: list = []
                probe = threading.Thread(target=lambda b=box: b.append(asyncio.run(_greedy(old))))
                probe.start()
                probe.join(60)
                seen.append(box[0])
            yield item

    async def _greedy(model) -> str:
        async with EngineClient(server.url, timeout=30) as c:
            return await greedy_matches(c, model)

    async def go():
        async with EngineClient(server.url, timeout=30) as client:
            sender = WeightSender(group_name="unpaused", timeout_s=GROUP_TIMEOUT)
            await sender.init_group([client], backend="gloo")
            await sender.sync(old.named_parameters(), 30, bucket_bytes=16_000)
            params = list(new.named_parameters())
            stats = await sender.sync(probing(params, len(params) - 2), 31, bucket_bytes=16_000,
                                      load_format="auto", pause_mode=None)  # fmt: skip
            assert stats.buckets >= 3 and seen == ["30"]  # old weights, old version, mid-sync
            assert await greedy_matches(client, new) == "31"
            # a bad last bucket: the held ones are dropped, the model stays at 31
            bad = [*old.named_parameters(), ("lm_head.weight", torch.zeros(2, 2))]
            with pytest.raises(WeightSyncError, match="shape mismatch"):
                await sender.sync(bad, 32, bucket_bytes=16_000, load_format=None, pause_mode=None)
            assert await greedy_matches(client, new) == "31"
            await sender.close()

    asyncio.run(go())

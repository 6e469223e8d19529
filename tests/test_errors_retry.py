"""Rollout errors are classified: a retriable one (engine busy, unreachable, a timeout) is
tried again with backoff and a cap; a permanent one (an engine's 4xx, a reward that raises or
lacks its column, a bogus reward function, a worker that cannot start) fails the run at once
with the real message whole, instead of a batch timeout with the message cut.

The rollout worker, its builder and sender, the receiver, dispatcher, replay queue and
orchestrator are real; only the engine (a tiny aiohttp server scripted by each test) and, for
the dispatcher, the pool of workers are made up."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest
from aiohttp import web

from asyncrl.config.schema import RolloutConfig
from asyncrl.data.prompts import PromptItem
from asyncrl.engine.client import EngineError, EngineTimeoutError
from asyncrl.net import free_port
from asyncrl.orchestrator import Orchestrator
from asyncrl.replay import ReplayConfig, ReplayQueue
from asyncrl.rewards import RewardError
from asyncrl.rollout.dispatch import Dispatcher
from asyncrl.rollout.multiturn import EpisodeError
from asyncrl.rollout.ray_pool import _RayRolloutWorker
from asyncrl.rollout.settings import PermanentRolloutError, PromptResult, RolloutSettings
from asyncrl.rollout.worker import RolloutWorker, is_retriable
from asyncrl.transport.codec import EncodeError
from asyncrl.transport.zmq import Receiver, ReceiverConfig, TransportTimeout
from tests.test_dispatch import FakePool, prompts

pytestmark = pytest.mark.timeout(180)
SECRET = b"s" * 32
# The engine's real complaint comes last: a message cut at 300 characters (as rollout errors
# were) would lose it. (The engine client itself keeps up to 300 characters of a reply body.)
LONG_4XX = "x" * 240 + " -- the real reason: input_ids too long for this model"


def reads_a_missing_column(prompt: str, response: str, metadata: Mapping[str, Any]) -> float:
    """A user reward that indexes a column the data does not have."""
    return float(metadata["solution"] == response)


class ScriptedEngine:
    """/generate answers `statuses` in order (then 200): a status >= 400 gets an error body.
    A batch (a group's samples in SGLang's list form: one call per try) gets a list."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses, self.calls = list(statuses), []
        self.extra_keys: list[object] = []  # each call's prefix-cache namespace(s)

    async def generate(self, request: web.Request) -> web.Response:
        self.calls.append(time.monotonic())
        body = await request.json()
        self.extra_keys.append(body.get("extra_key"))
        status = self.statuses.pop(0) if self.statuses else 200
        if status >= 400:
            body = {"object": "error", "message": LONG_4XX, "code": status}  # as SGLang's
            return web.json_response(body, status=status)
        ids = [22]  # "2" in the embedded tokenizer
        meta = {"id": "r", "finish_reason": {"type": "stop"}, "prompt_tokens": 3,
                "weight_version": "0", "output_token_logprobs": [[-0.2, 22, None]]}  # fmt: skip
        one = {"text": "2", "output_ids": ids, "meta_info": meta}
        prompts = body["input_ids"]
        return web.json_response([one] * len(prompts) if isinstance(prompts[0], list) else one)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from asyncrl.models.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(path)
    return path


def worker_settings(tok_dir, port: int, receiver: Receiver, **rollout: Any) -> RolloutSettings:
    return RolloutSettings(
        engine_urls=[f"http://127.0.0.1:{port}"], transport_host="127.0.0.1",
        transport_port=receiver.port, tokenizer_path=str(tok_dir), n=2,
        rollout=RolloutConfig(request_timeout_s=5, **rollout), transport_secret=SECRET,
        retry_attempts=3, retry_backoff_s=0.2, retry_backoff_max_s=0.3,
    )  # fmt: skip


def run_one(tok_dir, statuses: list[int], item: PromptItem, **rollout: Any):
    """One prompt through a real RolloutWorker against the scripted engine: (result, engine,
    the groups that reached the receiver)."""
    engine = ScriptedEngine(statuses)

    async def go(receiver: Receiver) -> PromptResult:
        app = web.Application()
        app.router.add_post("/generate", engine.generate)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        loop = asyncio.get_running_loop()
        settings = worker_settings(tok_dir, port, receiver, **rollout)
        worker = await loop.run_in_executor(None, RolloutWorker, settings)
        try:
            [result] = await worker.run_prompts([item])
        finally:
            await worker.aclose()
            assert all(c.http._session is None for c in worker.builder.clients)  # closed, not left
            await runner.cleanup()
        return result

    with Receiver(ReceiverConfig(secret=SECRET)) as receiver:
        result = asyncio.run(go(receiver))
        groups = []
        if result.ok:
            groups.append(receiver.get(timeout_s=30))
    return result, engine, groups


@contextlib.contextmanager
def _serving(handler):
    """A /generate answered by `handler` on a loop of its own thread; yields its port."""
    loop, port = asyncio.new_event_loop(), free_port()
    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app)

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


def item(**metadata: Any) -> PromptItem:
    return PromptItem("e0-i0", [15, 10, 17], "1+1=", metadata or {"answer": "2"})


def test_a_busy_engine_is_retried_with_backoff_then_the_group_arrives(tok_dir):
    result, engine, groups = run_one(tok_dir, [503], item())  # try 1: the group's one request
    assert result.ok and not result.permanent and result.error == ""
    assert [g.group_id for g in groups] == ["e0-i0"] and groups[0].rewards.tolist() == [1.0, 1.0]
    assert len(engine.calls) == 2  # try 1: 503, try 2: 200 (each: one batch of n=2 samples)
    assert engine.calls[1] - engine.calls[0] >= 0.1  # it waited (backoff 0.2 s, jitter 0.5-1)


def test_a_prompt_stamped_with_the_synced_version_uses_its_cache_namespace(tok_dir):
    """The dispatcher's stamp (`PromptItem.engine_version`) reaches the worker's engine client
    before its first request: no request after a sync uses the old version's namespace."""
    stamped = PromptItem("e0-i0", [15, 10, 17], "1+1=", {"answer": "2"}, engine_version=7)
    result, engine, _ = run_one(tok_dir, [], stamped)
    assert result.ok and engine.extra_keys == ["asyncrl-w7"]  # a batch of n=2: one namespace


def test_a_retriable_error_gives_up_after_the_cap_and_is_reissued(tok_dir):
    result, engine, groups = run_one(tok_dir, [503] * 3, item())
    assert not result.ok and not result.permanent and groups == []
    assert len(engine.calls) == 3  # retry_attempts=3 tries (one batched request each), reported
    gaps = [b - a for a, b in zip(engine.calls, engine.calls[1:], strict=False)]
    assert len(gaps) == 2 and all(gap >= 0.1 for gap in gaps)
    assert "HTTP 503" in result.error and result.error.index("the real reason") > 300


def test_an_engine_4xx_fails_the_prompt_permanently_at_once_with_the_whole_message(tok_dir):
    result, engine, groups = run_one(tok_dir, [400], item())
    assert not result.ok and result.permanent and groups == []
    assert len(engine.calls) == 1  # one try: no retry for an answer that will not change
    assert "answered HTTP 400" in result.error
    assert result.error.index("the real reason: input_ids too long for this model") > 300


@pytest.mark.parametrize(
    ("reward_fn", "metadata", "expected"),
    [
        ("arithmetic_exact", {"question": "1+1"}, "needs an 'answer' metadata column"),
        ("tests.test_errors_retry:reads_a_missing_column", {"answer": "2"}, "KeyError: 'solution'"),
    ],
)
def test_a_reward_that_raises_is_permanent_and_named(tok_dir, reward_fn, metadata, expected):
    result, engine, _ = run_one(tok_dir, [], item(**metadata), reward_fn=reward_fn)
    assert not result.ok and result.permanent and len(engine.calls) == 1
    assert f"reward_fn {reward_fn!r} failed on prompt e0-i0" in result.error
    assert expected in result.error


def test_a_worker_that_cannot_start_reports_why_on_every_prompt(tok_dir):
    with Receiver(ReceiverConfig(secret=SECRET)) as receiver:
        settings = worker_settings(tok_dir, 9, receiver, reward_fn="bogus")
        shell = _RayRolloutWorker(settings)  # the Ray actor's body, without Ray
    assert "unknown reward 'bogus'" in shell.started()
    results = asyncio.run(shell.run_prompts([item(), PromptItem("e0-i1", [1])]))
    assert [(r.key, r.ok, r.permanent) for r in results] == [
        ("e0-i0", False, True),
        ("e0-i1", False, True),
    ]
    assert results[0].error.startswith("rollout worker failed to start: RewardError: unknown")


def test_a_rollout_worker_that_cannot_start_stops_the_pool_at_once(tok_dir):
    import ray

    from asyncrl.rollout.ray_pool import RayWorkerPool

    started_here = not ray.is_initialized()
    try:
        with Receiver(ReceiverConfig(secret=SECRET)) as receiver:
            settings = worker_settings(tok_dir, 9, receiver, reward_fn="bogus")
            with pytest.raises(PermanentRolloutError) as raised:
                RayWorkerPool(lambda index: settings, 2)  # no respawn loop: it raises
    finally:
        if started_here:
            ray.shutdown()
    message = str(raised.value)
    assert message.startswith("rollout worker 0 failed to start: RewardError: unknown reward")
    assert message.endswith("(or a 'package.module:function' path)")  # whole, not cut


def test_classification():
    retriable = [
        EngineError("u", "/generate failed: ClientConnectorError: connection refused"),
        EngineError("u", "/generate answered HTTP 503: busy"),
        EngineError("u", "/generate answered HTTP 429: too many requests"),
        EngineTimeoutError("u", "/generate gave no reply within 5s"),
        TransportTimeout("send blocked"),
        ConnectionResetError("reset by peer"),
        EpisodeError("env reset(seed=3): boom"),
    ]
    permanent = [
        EngineError("u", "/generate answered HTTP 400: bad request"),
        EngineError("u", "/generate answered HTTP 401: Unauthorized"),
        RewardError("unknown reward 'bogus'"),
        PermanentRolloutError("reward_fn failed"),
        EncodeError("metadata: object is not a plain wire value"),
        KeyError("answer"),
        TypeError("a bug"),
    ]
    assert [is_retriable(e) for e in retriable] == [True] * len(retriable)
    assert [is_retriable(e) for e in permanent] == [False] * len(permanent)


def test_a_permanent_failure_fails_take_batch_at_once_with_the_message_whole():
    queue = ReplayQueue(ReplayConfig(max_staleness=1, rollout_batch_size=2))
    next_prompt, _ = prompts()
    pool = FakePool(2)
    error = f"PermanentRolloutError: reward_fn 'mine' failed: {'y' * 400}: the real reason"
    with Dispatcher(pool, queue, next_prompt, max_inflight_per_worker=2) as dispatcher:
        deadline = time.monotonic() + 30
        while not pool.started():
            assert time.monotonic() < deadline, "nothing was dispatched"
            time.sleep(0.01)
        handle, items = pool.started()[0]
        started = time.monotonic()
        pool.finish(handle, [PromptResult(items[0].key, ok=False, error=error, permanent=True)])
        while dispatcher.error is None:  # the dispatcher's thread reaps it
            assert time.monotonic() < deadline, "the permanent failure was not seen"
            time.sleep(0.01)
        rollout = Orchestrator(RolloutConfig(request_timeout_s=60), None, dispatcher, None, queue, None)  # fmt: skip
        with pytest.raises(PermanentRolloutError) as raised:
            rollout.take_batch(2, 0)  # the batch timeout is 120 s: it must not be waited out
    assert time.monotonic() - started < 10
    assert str(raised.value) == f"rollout worker 0, prompt {items[0].key}: {error}"
    assert dispatcher.counters["permanent_failures"] == 1
    # the ledger still holds every prompt (pending or in flight): a checkpoint loses none
    assert queue.metrics()["running"] == 4


def test_a_worker_that_keeps_dying_fails_the_run_instead_of_respawning_forever():
    from asyncrl.rollout import ray_pool
    from asyncrl.rollout.settings import MAX_CONSECUTIVE_DEATHS, Wakeup

    class DyingPool:  # RayWorkerPool.poll's bookkeeping, with Ray's side made up
        poll = ray_pool.RayWorkerPool.poll

        def __init__(self) -> None:
            self.refs, self.generation, self.deaths, self.replaced = {}, [0], [0], 0
            self._ray, self._wakeup = self, Wakeup()

        def get(self, ref):
            raise RuntimeError(f"actor died ({ref})")

        def _replace(self, actor):
            self.generation[actor] += 1
            self.replaced += 1

    pool = DyingPool()
    outcomes = []
    for attempt in range(MAX_CONSECUTIVE_DEATHS):
        ended = cf.Future()  # the submission ended (its actor died)
        ended.set_result(None)
        pool.refs[f"ref{attempt}"] = (0, pool.generation[0], ended)
        outcomes += [outcome for _, _, outcome in pool.poll(0.1)]
    assert [type(o).__name__ for o in outcomes] == ["RuntimeError", "RuntimeError",
                                                    "PermanentRolloutError"]  # fmt: skip
    assert "died 3 times in a row; last: RuntimeError: actor died (ref2)" in str(outcomes[-1])


@pytest.mark.timing
def test_a_ray_pools_poll_ends_on_wake_with_a_submission_in_flight(tok_dir):
    """`RayWorkerPool.poll` waits on its submissions and on `wake` at once: a wake from another
    thread ends a long poll while a submission still runs (the engine never answers)."""
    import ray

    from asyncrl.rollout.ray_pool import RayWorkerPool

    silent = threading.Event()  # the engine holds every request until the test ends

    async def hold(request: web.Request) -> web.Response:
        await asyncio.get_running_loop().run_in_executor(None, silent.wait, 60)
        return web.json_response({})

    started_here = not ray.is_initialized()
    try:
        with Receiver(ReceiverConfig(secret=SECRET)) as receiver, _serving(hold) as port:
            pool = RayWorkerPool(lambda index: worker_settings(tok_dir, port, receiver), 1)
            try:
                pool.submit(0, [item()])
                returned, got = threading.Event(), []
                poller = threading.Thread(target=lambda: (got.extend(pool.poll(600)),
                                                          returned.set()))  # fmt: skip
                poller.start()
                pool.wake()
                assert returned.wait(30), "wake did not end the poll"
                assert got == [] and len(pool.refs) == 1  # nothing ended: it was the wake
            finally:
                silent.set()
                pool.close()
    finally:
        if started_here:
            ray.shutdown()

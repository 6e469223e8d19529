"""Rollout workers as threads of the driver (`rollout/local_pool.py`, `rollout.worker_pool:
driver`): real RolloutWorkers against a scripted engine, groups pushed to a real receiver;
a worker that cannot start stops the pool at once with the real message; `poll` ends on
`wake`; a worker that keeps failing ends the run; close ends the workers' threads."""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import web

from asyncrl.data.prompts import PromptItem
from asyncrl.rollout.local_pool import LocalWorkerPool
from asyncrl.rollout.settings import MAX_CONSECUTIVE_DEATHS, PermanentRolloutError
from asyncrl.transport.zmq import Receiver, ReceiverConfig
from tests.test_errors_retry import SECRET, ScriptedEngine, _serving, item, worker_settings
from tests.test_errors_retry import tok_dir as tok_dir  # noqa: F401 - the module's fixture

pytestmark = pytest.mark.timeout(180)


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("asyncrl-rollout-")}


def test_workers_generate_and_push_groups(tok_dir):  # noqa: F811
    engine = ScriptedEngine([])
    with Receiver(ReceiverConfig(secret=SECRET)) as receiver, _serving(engine.generate) as port:
        pool = LocalWorkerPool(lambda index: worker_settings(tok_dir, port, receiver), 2)
        try:
            assert pool.size() == 2 and len(_threads()) == 2
            second = PromptItem("e0-i1", [15, 10, 15], "1+0=", {"answer": "1"})
            refs = {pool.submit(0, [item()]), pool.submit(1, [second])}
            done = []
            while len(done) < 2:
                done += pool.poll(30)
            assert {ref for _, ref, _ in done} == refs
            results = {r.key: r for _, _, out in done for r in out}
            assert sorted(results) == ["e0-i0", "e0-i1"]
            assert all(r.ok for r in results.values()), results
            groups = [receiver.get(timeout_s=30) for _ in range(2)]
            assert sorted(g.group_id for g in groups) == ["e0-i0", "e0-i1"]
        finally:
            pool.close()
    assert not _threads()  # close ended them


def test_a_worker_that_cannot_start_stops_the_pool_at_once(tok_dir):  # noqa: F811
    with Receiver(ReceiverConfig(secret=SECRET)) as receiver:
        settings = worker_settings(tok_dir, 9, receiver, reward_fn="bogus")
        with pytest.raises(PermanentRolloutError) as raised:
            LocalWorkerPool(lambda index: settings, 2)
    message = str(raised.value)
    assert message.startswith("rollout worker 0 failed to start: RewardError: unknown reward")
    assert message.endswith("(or a 'package.module:function' path)")  # whole, not cut
    assert not _threads()


def test_poll_ends_on_wake_with_a_submission_in_flight(tok_dir):  # noqa: F811
    silent = threading.Event()  # the engine holds every request until the test ends

    async def hold(request: web.Request) -> web.Response:
        await asyncio.get_running_loop().run_in_executor(None, silent.wait, 60)
        return web.json_response({})

    with Receiver(ReceiverConfig(secret=SECRET)) as receiver, _serving(hold) as port:
        pool = LocalWorkerPool(lambda index: worker_settings(tok_dir, port, receiver), 1)
        try:
            pool.submit(0, [item()])
            returned, got = threading.Event(), []
            poller = threading.Thread(target=lambda: (got.extend(pool.poll(600)), returned.set()))
            poller.start()
            pool.wake()
            assert returned.wait(30), "wake did not end the poll"
            assert got == [] and len(pool.refs) == 1  # nothing ended: it was the wake
        finally:
            silent.set()
            pool.close()


def test_a_worker_that_keeps_failing_ends_the_run(tok_dir):  # noqa: F811
    """A submission that raises comes back as its exception (its prompts are re-issued);
    `MAX_CONSECUTIVE_DEATHS` in a row from one worker turn into a permanent failure."""
    with Receiver(ReceiverConfig(secret=SECRET)) as receiver:
        pool = LocalWorkerPool(lambda index: worker_settings(tok_dir, 9, receiver), 1)
        try:
            worker = pool.hosts[0].worker

            async def broken(items):  # a bug in the worker's own code, say
                raise RuntimeError(f"broken on {items[0].key}")

            worker.run_prompts = broken
            outcomes = []
            for attempt in range(MAX_CONSECUTIVE_DEATHS):
                pool.submit(0, [PromptItem(f"e0-i{attempt}", [1])])
                while len(outcomes) <= attempt:
                    outcomes += [outcome for _, _, outcome in pool.poll(30)]
        finally:
            pool.close()
    assert [type(o).__name__ for o in outcomes] == [
        "RuntimeError", "RuntimeError", "PermanentRolloutError",
    ]  # fmt: skip
    assert "failed 3 times in a row; last: RuntimeError: broken on e0-i2" in str(outcomes[-1])

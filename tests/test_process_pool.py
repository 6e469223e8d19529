"""Rollout workers as child processes of the driver (`rollout/process_pool.py`,
`rollout.worker_pool: process`): real RolloutWorkers in real child processes against a scripted
engine, groups pushed to a real receiver; a worker that cannot start stops the pool at once
with the real message; a worker process killed mid-submission is replaced and its prompts
re-issued by the real dispatcher; one that keeps dying ends the run; the workers end with the
driver, even one killed by `kill -9`; and a real shrunk loop runs on them without Ray."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from aiohttp import web

from asyncrl.data.prompts import PromptItem
from asyncrl.replay import ReplayConfig, ReplayQueue
from asyncrl.rollout.dispatch import Dispatcher
from asyncrl.rollout.process_pool import ProcessWorkerPool, RolloutWorkerDied
from asyncrl.rollout.settings import MAX_CONSECUTIVE_DEATHS, PermanentRolloutError
from asyncrl.transport.zmq import Receiver, ReceiverConfig
from tests.helpers import descendants, running, wait_for
from tests.test_errors_retry import SECRET, ScriptedEngine, _serving, item, worker_settings
from tests.test_errors_retry import tok_dir as tok_dir  # noqa: F401 - the module's fixture

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[1]


def children() -> set[int]:
    return descendants(os.getpid()) - {os.getpid()}


def _holding_engine(release: threading.Event, arrived: threading.Event):
    """/generate that says a request arrived, then answers only once `release` is set."""
    engine = ScriptedEngine([])

    async def hold(request: web.Request) -> web.Response:
        arrived.set()
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 120)
        return await engine.generate(request)

    return hold


def test_workers_are_child_processes_that_generate_and_push_groups(tok_dir):  # noqa: F811
    engine = ScriptedEngine([])
    with Receiver(ReceiverConfig(secret=SECRET)) as receiver, _serving(engine.generate) as port:
        pool = ProcessWorkerPool(lambda index: worker_settings(tok_dir, port, receiver), 2)
        try:
            pids = pool.pids()
            assert pool.size() == 2 and len(set(pids)) == 2 and os.getpid() not in pids
            assert set(pids) <= children()  # children of this process, not Ray's
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
            assert pool.metrics() == {
                "rollout/worker_processes": 2.0, "rollout/worker_restarts": 0.0,
            }  # fmt: skip
        finally:
            pool.close()
    assert not any(running(pid) for pid in pids)  # close ended them


def test_a_worker_that_cannot_start_stops_the_pool_at_once(tok_dir):  # noqa: F811
    before = children()
    with Receiver(ReceiverConfig(secret=SECRET)) as receiver:
        settings = worker_settings(tok_dir, 9, receiver, reward_fn="bogus")
        with pytest.raises(PermanentRolloutError) as raised:
            ProcessWorkerPool(lambda index: settings, 2)
    message = str(raised.value)
    assert message.startswith("rollout worker 0 failed to start: RewardError: unknown reward")
    assert message.endswith("(or a 'package.module:function' path)")  # whole, not cut
    assert not children() - before  # the pool ended its workers before it raised


def test_poll_ends_on_wake_with_a_submission_in_flight(tok_dir):  # noqa: F811
    release, arrived = threading.Event(), threading.Event()
    with (
        Receiver(ReceiverConfig(secret=SECRET)) as receiver,
        _serving(_holding_engine(release, arrived)) as port,
    ):
        pool = ProcessWorkerPool(lambda index: worker_settings(tok_dir, port, receiver), 1)
        try:
            pool.submit(0, [item()])
            returned, got = threading.Event(), []
            poller = threading.Thread(target=lambda: (got.extend(pool.poll(600)), returned.set()))
            poller.start()
            pool.wake()
            assert returned.wait(30), "wake did not end the poll"
            assert got == [] and len(pool.refs) == 1  # nothing ended: it was the wake
        finally:
            release.set()
            pool.close()


def test_a_killed_worker_is_replaced_and_its_prompts_reissued(tok_dir):  # noqa: F811
    """The real dispatcher and ledger: the prompt the killed worker held goes back to pending,
    is handed to its replacement, and reaches the receiver."""
    release, arrived = threading.Event(), threading.Event()
    with (
        Receiver(ReceiverConfig(secret=SECRET)) as receiver,
        _serving(_holding_engine(release, arrived)) as port,
    ):
        pool = ProcessWorkerPool(lambda index: worker_settings(tok_dir, port, receiver), 1)
        queue = ReplayQueue(ReplayConfig(max_staleness=0, rollout_batch_size=1))
        keys = iter(f"e0-i{i}" for i in range(1000))

        def next_prompt() -> PromptItem:
            return PromptItem(next(keys), [15, 10, 17], "1+1=", {"answer": "2"})

        first, cpus = pool.pids()[0], os.sched_getaffinity(0)
        # The driver pins itself once its workers started (a child inherits its creator's
        # affinity): the dispatcher's thread, which spawns the replacement, is pinned here.
        os.sched_setaffinity(0, {min(cpus)})
        try:
            with Dispatcher(pool, queue, next_prompt, max_inflight_per_worker=1) as dispatcher:
                assert arrived.wait(60), "no request reached the engine"
                held = [p["key"] for p in queue.admission.outstanding()]
                assert held == ["e0-i0"]
                os.kill(first, signal.SIGKILL)
                wait_for(lambda: dispatcher.counters["reissued"] >= 1, "the re-issue", 60)
                release.set()
                group = receiver.get(timeout_s=60)
                assert dispatcher.error is None
                assert os.sched_getaffinity(pool.pids()[0]) == cpus  # the replacement: not pinned
        finally:
            os.sched_setaffinity(0, cpus)
            release.set()
            pool.close()
    assert group.group_id == "e0-i0"  # the replacement delivered the killed worker's prompt
    assert pool.restarts == 1 and dispatcher.counters["actor_failures"] == 1
    assert "process (pid" in dispatcher.last_error and "killed by SIGKILL" in dispatcher.last_error
    assert not running(first)


def test_a_worker_that_keeps_dying_ends_the_run(tok_dir):  # noqa: F811
    """Each replacement is killed with the submission in its pipe, before it even starts."""
    with Receiver(ReceiverConfig(secret=SECRET)) as receiver:
        pool = ProcessWorkerPool(lambda index: worker_settings(tok_dir, 9, receiver), 1)
        outcomes, killed = [], []
        try:
            for attempt in range(MAX_CONSECUTIVE_DEATHS):
                pool.submit(0, [PromptItem(f"e0-i{attempt}", [15, 10, 17], "1+1=")])
                killed.append(pool.pids()[0])
                os.kill(killed[-1], signal.SIGKILL)
                while len(outcomes) <= attempt:
                    outcomes += [outcome for _, _, outcome in pool.poll(30)]
        finally:
            pool.close()
    assert [type(o) for o in outcomes] == [
        RolloutWorkerDied, RolloutWorkerDied, PermanentRolloutError,
    ]  # fmt: skip
    assert "died 3 times in a row; last: RolloutWorkerDied: rollout worker 0's process" in str(
        outcomes[-1]
    )
    assert pool.restarts == MAX_CONSECUTIVE_DEATHS and len(set(killed)) == MAX_CONSECUTIVE_DEATHS
    assert not any(running(pid) for pid in killed)


# A driver that starts two workers, says their pids, then waits to be killed.
DRIVER = """
import sys, threading
from asyncrl.rollout.process_pool import ProcessWorkerPool
from asyncrl.rollout.settings import RolloutSettings
from asyncrl.transport.zmq import Receiver, ReceiverConfig
receiver = Receiver(ReceiverConfig(secret=b"s" * 32))
settings = RolloutSettings(["http://127.0.0.1:9"], "127.0.0.1", receiver.port, sys.argv[1],
                           transport_secret=b"s" * 32)
pool = ProcessWorkerPool(lambda i: settings, 2)
print(" ".join(map(str, pool.pids())), flush=True)
threading.Event().wait()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_kill_9_of_the_driver_leaves_no_worker_behind(tok_dir):  # noqa: F811
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tok_dir)], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2 and all(running(pid) for pid in pids)
        driver.kill()
        driver.wait(30)
        wait_for(lambda: not any(running(pid) for pid in pids), "the workers to exit", 30)
    finally:
        if driver.poll() is None:
            driver.kill()


def test_a_run_on_worker_processes_trains_and_never_starts_ray(tiny_model, tmp_path, monkeypatch):
    """`rollout.worker_pool: process` on the one-host default: the engines are the driver's
    subprocesses and the one-process learner needs no Ray, so Ray never starts; the rollout
    workers were child processes of the driver (the metrics say so), ended with the run, and
    decoded with the driver's `tokenizers` backend."""
    import asyncrl.run as run_module
    from asyncrl import net
    from asyncrl.startup import WorkerStart
    from tests.test_e2e import read_rows, shrunk

    def no_ray(*args, **kwargs):
        raise AssertionError("the run started Ray")

    seen: dict[str, object] = {}
    pool = WorkerStart.pool

    def spy_pool(workers):
        seen["pool"] = pool(workers)
        seen["pids"] = seen["pool"].pids()
        seen["settings"] = workers.settings(0)
        return seen["pool"]

    monkeypatch.setattr(net, "_init_ray", no_ray)
    monkeypatch.setattr(WorkerStart, "pool", spy_pool)
    extra = ("max_steps=2", "logging.eval_interval=0", "rollout.worker_pool=process")
    summary = run_module.run(shrunk(tiny_model, tmp_path, *extra))
    assert summary["steps"] >= 2
    assert isinstance(seen["pool"], ProcessWorkerPool) and len(seen["pids"]) == 2
    # the workers decoded with the driver's tokenizers backend, never importing transformers
    # (tests/test_tokenizer_load.py: the same text as transformers' for the same ids)
    assert seen["settings"].tokenizer_json
    assert not any(running(pid) for pid in seen["pids"])  # ended with the run
    rows = [r for r in read_rows(tmp_path) if r.get("version") is not None]
    assert all(r["rollout/worker_processes"] == 2 for r in rows)
    assert rows[-1]["transport/received"] >= 2 * 2  # the groups came from the processes


def test_a_failed_learner_build_ends_the_worker_processes_started_before_it(
    tiny_model, tmp_path, monkeypatch
):
    import asyncrl.run as run_module
    from asyncrl.startup import WorkerStart
    from tests.test_e2e import shrunk

    seen: dict[str, object] = {}
    start = WorkerStart.__init__

    def spy_start(workers, *args, **kwargs):
        seen["workers"] = workers
        return start(workers, *args, **kwargs)

    def failing_build(*args, **kwargs):
        seen["pids"] = seen["workers"].pool().pids()  # their start is under way: let it end
        raise RuntimeError("learner build failed")

    monkeypatch.setattr(WorkerStart, "__init__", spy_start)
    monkeypatch.setattr(run_module, "build_learner", failing_build)
    with pytest.raises(RuntimeError, match="learner build failed"):
        run_module.run(shrunk(tiny_model, tmp_path, "rollout.worker_pool=process"))
    assert len(seen["pids"]) == 2 and not any(running(pid) for pid in seen["pids"])


def test_worker_processes_are_refused_where_workers_run_beside_engines_on_the_nodes():
    from asyncrl.config import ConfigError, load_config

    cluster = [
        "cluster.address=auto",
        "cluster.bind_host=0.0.0.0",
        "rollout.transport_host=0.0.0.0",
    ]
    with pytest.raises(ConfigError, match="rollout.worker_pool 'process' with cluster.address"):
        load_config(None, [*cluster, "rollout.worker_pool=process"])
    load_config(None, [*cluster, "rollout.worker_pool=ray"])  # ray stays the cluster's

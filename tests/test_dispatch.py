"""The dispatcher and the run's one in-flight ledger, with the workers faked in-process (the
edge); the replay queue, its admission and the dispatcher are the real ones.

A prompt is always exactly one of pending, in flight or delivered; a failed worker's prompts
are re-issued first; a checkpoint re-issues exactly the outstanding prompts; admission never
lets ``accepted + running`` exceed the budget."""

from __future__ import annotations

import itertools
import queue as stdqueue
import random
import threading
import time
from typing import Any

import pytest

from asyncrl.checkpoint import dump_msgpack, load_msgpack
from asyncrl.data.prompts import PromptItem
from asyncrl.orchestrator import Orchestrator
from asyncrl.replay import DuplicateGroupError, ReplayConfig, ReplayQueue
from asyncrl.rollout.dispatch import Dispatcher
from asyncrl.rollout.settings import PromptResult
from asyncrl.types import TrajectoryGroup


class FakePool:
    """In-process workers: the test decides when each submission ends, and how."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.submissions: list[tuple[int, list[str]]] = []  # (worker, keys), handle = index
        self.open: dict[int, tuple[int, list[PromptItem]]] = {}
        self._done: stdqueue.Queue = stdqueue.Queue()
        self._lock = threading.Lock()
        self.polls, self.waiting = 0, False  # polls begun; whether one is waiting now

    def size(self) -> int:
        return self.workers

    def submit(self, worker: int, items: list[PromptItem]) -> int:
        with self._lock:
            handle = len(self.submissions)
            self.submissions.append((worker, [it.key for it in items]))
            self.open[handle] = (worker, items)
        return handle

    def started(self) -> list[tuple[int, list[PromptItem]]]:
        """The submissions still running, oldest first: (handle, items)."""
        with self._lock:
            return [(h, items) for h, (_, items) in sorted(self.open.items())]

    def finish(self, handle: int, outcome: list[PromptResult] | Exception | None = None) -> None:
        """End a submission: all ok (None), per-prompt results, or the worker's death."""
        with self._lock:
            worker, items = self.open.pop(handle)
        if outcome is None:
            outcome = [PromptResult(it.key, ok=True) for it in items]
        self._done.put((worker, handle, outcome))

    def wake(self) -> None:
        self._done.put(None)  # ends a poll's wait; not a result

    def poll(self, timeout: float) -> list[tuple[int, Any, list[PromptResult] | Exception]]:
        self.polls, self.waiting = self.polls + 1, True
        out = []
        try:
            out.append(self._done.get(timeout=timeout))
            while True:
                out.append(self._done.get_nowait())
        except stdqueue.Empty:
            return [x for x in out if x is not None]
        finally:
            self.waiting = False


def group_for(key: str, version: int) -> TrajectoryGroup:
    responses = [
        {"response_ids": [3, 4], "rollout_logprobs": [-0.5, -0.5], "versions": [version] * 2,
         "reward": reward, "finish_reason": "stop"}
        for reward in (0.0, 1.0)
    ]  # fmt: skip
    return TrajectoryGroup.from_responses(key, [1, 2], responses, {"prompt_key": key})


def prompts(prefix: str = "p"):
    counter = itertools.count()
    drawn: list[str] = []

    def next_prompt() -> PromptItem:
        drawn.append(f"{prefix}{next(counter)}")
        return PromptItem(key=drawn[-1], prompt_ids=[1, 2], metadata={"n": len(drawn)})

    return next_prompt, drawn


def ledger(replay: ReplayQueue) -> tuple[list[str], list[str]]:
    """(pending keys in re-issue order, in-flight keys) from the one ledger."""
    keys = [p["key"] for p in replay.admission.outstanding()]
    pending = replay.admission.pending()
    return keys[:pending], keys[pending:]


def check_invariants(replay: ReplayQueue, drawn: list[str], delivered: set[str], slots: int):
    pending, flying = ledger(replay)
    assert len(set(pending) | set(flying) | delivered) == len(pending) + len(flying) + len(
        delivered
    ), "a prompt is in two states at once"
    assert set(pending) | set(flying) | delivered == set(drawn), "a prompt was lost"
    assert max(replay.admission.load(4), default=0) <= slots
    m = replay.metrics()
    assert m["accepted"] + m["running"] <= m["budget"] and m["unreserved"] == 0


class Deliveries:
    """The receive pump's side: groups put into the queue, at once or after a while."""

    def __init__(self, replay: ReplayQueue) -> None:
        self.replay, self.delivered, self.in_transit = replay, set(), []

    def deliver(self, group: TrajectoryGroup) -> None:
        try:
            self.replay.put(group, prompt_key=group.group_id)
        except DuplicateGroupError:
            assert group.group_id in self.delivered  # only a prompt delivered already
            return
        assert group.group_id not in self.delivered
        self.delivered.add(group.group_id)


def end_submission(rng: random.Random, pool: FakePool, handle: int, version: int, out: Deliveries):
    """One way a submission can end, drawn at random, with its groups' fates."""
    groups = [group_for(it.key, version) for it in pool.open[handle][1]]
    how = rng.choice(["ok", "ok_late", "crash", "crash_in_transit", "some_failed"])
    if how == "ok":
        for g in groups:
            out.deliver(g)
        pool.finish(handle)
    elif how == "ok_late":  # the worker's answer overtakes its groups
        out.in_transit.extend(groups)
        pool.finish(handle)
    elif how in ("crash", "crash_in_transit"):  # died after sending some groups
        for g in groups[: rng.randint(0, len(groups))]:
            if how == "crash_in_transit":
                out.in_transit.append(g)
            else:
                out.deliver(g)
        pool.finish(handle, RuntimeError("worker died"))
    else:
        results = []
        for g in groups:
            ok = rng.random() < 0.5
            if ok:
                out.deliver(g)
            results.append(PromptResult(g.group_id, ok=ok, error="" if ok else "boom"))
        pool.finish(handle, results)


def test_every_prompt_is_exactly_one_of_pending_in_flight_delivered():
    rng = random.Random(7)
    replay = ReplayQueue(ReplayConfig(max_staleness=1, rollout_batch_size=3))
    next_prompt, drawn = prompts()
    pool = FakePool(4)
    dispatcher = Dispatcher(pool, replay, next_prompt, max_inflight_per_worker=2)
    out = Deliveries(replay)
    born: dict[int, int] = {}  # handle -> version when submitted
    for _ in range(600):
        op = rng.choice(["dispatch", "end", "end", "reap", "late", "learn"])
        if op == "dispatch":
            dispatcher.dispatch_once()
            for handle in pool.open:
                born.setdefault(handle, replay.version)
        elif op == "end" and pool.open:
            handle = rng.choice(sorted(pool.open))
            end_submission(rng, pool, handle, born[handle], out)
        elif op == "reap":
            dispatcher.reap(timeout=0)
        elif op == "late" and out.in_transit:
            out.deliver(out.in_transit.pop(rng.randrange(len(out.in_transit))))
        elif op == "learn":
            v = replay.version
            if replay.take(3, v) is not None:
                replay.set_version(v + 1)
        check_invariants(replay, drawn, out.delivered, slots=2)
    assert replay.version > 5 and dispatcher.counters["reissued"] > 0


def test_a_failed_workers_prompts_are_reissued_first():
    replay = ReplayQueue(ReplayConfig(max_staleness=3, rollout_batch_size=4))
    next_prompt, drawn = prompts()
    pool = FakePool(2)
    dispatcher = Dispatcher(pool, replay, next_prompt, max_inflight_per_worker=2)
    assert dispatcher.dispatch_once() == 4
    assert pool.submissions == [(0, ["p0", "p1"]), (1, ["p2", "p3"])]
    replay.put(group_for("p0", 0))  # p0's group got out before its worker died
    pool.finish(0, RuntimeError("killed"))
    pool.finish(1, [PromptResult("p2", ok=True), PromptResult("p3", ok=False, error="timeout")])
    replay.put(group_for("p2", 0))
    dispatcher.reap(timeout=1)
    assert ledger(replay) == (["p1", "p3"], [])
    assert dispatcher.dispatch_once() == 4
    # re-issued first (p1 to the first free worker, then p3), then fresh prompts
    assert pool.submissions[2:] == [(0, ["p1", "p3"]), (1, ["p4", "p5"])]
    assert dispatcher.counters["reissued"] == 2 and dispatcher.counters["actor_failures"] == 1
    assert dispatcher.counters["failed_prompts"] == 3  # p0, p1 (the dead worker), p3
    assert dispatcher.last_error == "timeout"  # the latest failure's reason


def test_checkpoint_then_restore_reissues_exactly_the_outstanding_prompts(tmp_path):
    cfg = ReplayConfig(max_staleness=2, rollout_batch_size=2)
    replay = ReplayQueue(cfg)
    next_prompt, drawn = prompts()
    pool = FakePool(3)
    dispatcher = Dispatcher(pool, replay, next_prompt, max_inflight_per_worker=2)
    dispatcher.dispatch_once()  # p0..p5 on workers 0, 1, 2
    replay.put(group_for("p0", 0))
    pool.finish(0, RuntimeError("gone"))  # p1 back to pending
    pool.finish(2)  # p4, p5 reported done; p4's group arrives, p5's is still in transit
    replay.put(group_for("p4", 0))
    dispatcher.reap(timeout=1)
    assert ledger(replay) == (["p1"], ["p2", "p3", "p5"])

    rollout = Orchestrator(None, None, dispatcher, None, replay, None)  # only its checkpoint
    dump_msgpack({"step": 1, **rollout.state_dict()}, tmp_path / "extra.msgpack")
    extra = load_msgpack(tmp_path / "extra.msgpack")
    assert [item["key"] for item in extra["outstanding"]] == ["p1", "p2", "p3", "p5"]
    assert "outstanding" not in extra["queue"]  # the ledger is stored once

    resumed = ReplayQueue(cfg)  # as `run.resume` loads it
    resumed.load_state_dict({**extra["queue"], "outstanding": extra["outstanding"]})
    assert resumed.metrics() == replay.metrics()
    pool2 = FakePool(3)
    next2, drawn2 = prompts("q")
    dispatcher2 = Dispatcher(pool2, resumed, next2, max_inflight_per_worker=2)
    assert resumed.metrics()["running"] == 4  # the re-issued count against the budget
    dispatcher2.dispatch_once()
    reissued = [key for _, keys in pool2.submissions for key in keys if key.startswith("p")]
    assert reissued == ["p1", "p2", "p3", "p5"]  # exactly the outstanding, pending first
    assert pool2.submissions[0] == (0, ["p1", "p2"])
    item = pool2.open[0][1][0]
    assert (item.key, item.prompt_ids, item.metadata) == ("p1", [1, 2], {"n": 2})
    assert drawn2 == []  # the budget counts the re-issued: no room for fresh prompts yet
    with pytest.raises(DuplicateGroupError):
        resumed.put(group_for("p4", 0))


def test_admission_never_exceeds_the_budget_under_threads():
    """Workers deliver on their own thread (some die mid-submission), the learner takes and
    publishes on another; every snapshot keeps ``accepted + running ≤ budget``."""
    s, b, target = 1, 4, 12
    replay = ReplayQueue(ReplayConfig(max_staleness=s, rollout_batch_size=b))
    next_prompt, drawn = prompts()
    pool = FakePool(3)
    done, trained, duplicates = threading.Event(), [], []

    def workers() -> None:
        rng = random.Random(3)
        while not done.wait(0.001):
            for handle, items in pool.started():
                keep = len(items) if rng.random() < 0.8 else rng.randint(0, len(items) - 1)
                for it in items[:keep]:
                    try:
                        replay.put(group_for(it.key, replay.version))
                    except DuplicateGroupError:
                        duplicates.append(it.key)
                pool.finish(handle, None if keep == len(items) else RuntimeError("died"))

    def learner() -> None:
        deadline = time.monotonic() + 60
        while replay.version < target and time.monotonic() < deadline:
            batch = replay.take(b, replay.version, timeout=0.5)
            if batch is not None:
                trained.extend(g.group_id for g in batch)
                replay.set_version(replay.version + 1)
        done.set()

    threads = [threading.Thread(target=workers), threading.Thread(target=learner)]
    with Dispatcher(pool, replay, next_prompt, max_inflight_per_worker=2):
        for t in threads:
            t.start()
        while not done.wait(0.002):
            m = replay.metrics()
            assert m["accepted"] + m["running"] <= m["budget"] and m["unreserved"] == 0
        for t in threads:
            t.join(10)
    assert replay.version == target, "the learner starved"
    assert duplicates == []  # a delivered prompt is never re-issued
    assert len(trained) == len(set(trained)) == target * b
    m = replay.metrics()
    assert m["put"] == m["taken"] + m["evicted"] + m["filtered"] + m["depth"]


def test_a_gate_closing_while_prompts_are_drawn_loses_none_of_them():
    """Under the wait policy the learner's `set_version` can close admission at any moment;
    the dispatcher counts capacity, draws and reserves as one step, so a version change from
    the loop's thread waits for it and no drawn prompt is left outside the ledger."""
    replay = ReplayQueue(ReplayConfig(max_staleness=1, rollout_batch_size=2, stale_policy="wait"))
    pool = FakePool(workers=2)
    draw, drawn = prompts()
    assert replay.reserve(1, ["long"]) == 1 and replay.admission.issue(0, 1)  # started at 0
    mover = threading.Thread(target=replay.set_version, args=(1,))  # "long" goes stale at 1

    def next_prompt() -> PromptItem:
        if not mover.is_alive() and not drawn:
            mover.start()
            mover.join(timeout=0.5)  # it cannot finish while the dispatcher holds admission
        return draw()

    dispatcher = Dispatcher(pool, replay, next_prompt, max_inflight_per_worker=4)
    dispatcher._admit_fresh(3)
    mover.join(timeout=30)
    assert not mover.is_alive() and replay.version == 1
    assert drawn and set(drawn) <= set(ledger(replay)[0])  # every drawn prompt is pending
    assert replay.capacity() == 0  # and now the gate holds: "long" is still in flight


def test_prompts_carry_the_engines_synced_version_when_handed_out():
    """Each prompt is stamped, when it is handed out (a re-issue too), with the version of the
    engines' last completed sync, so a worker's first request after a sync uses that version's
    prefix-cache namespace (`EngineClient.saw_version`)."""
    replay = ReplayQueue(ReplayConfig(max_staleness=3, rollout_batch_size=4))
    next_prompt, _ = prompts()
    pool, synced = FakePool(1), {"v": None}
    dispatcher = Dispatcher(pool, replay, next_prompt, 2, lambda: synced["v"])
    dispatcher.dispatch_once()
    assert [it.engine_version for _, its in pool.started() for it in its] == [None, None]
    synced["v"] = 3
    pool.finish(0, RuntimeError("killed"))
    dispatcher.reap(timeout=1)
    dispatcher.dispatch_once()  # the re-issues, stamped anew
    ((_, items),) = pool.started()
    assert [(it.key, it.engine_version, it.metadata) for it in items] == [
        ("p0", 3, {"n": 1}), ("p1", 3, {"n": 2})
    ]  # fmt: skip


@pytest.mark.timing
def test_a_new_version_hands_out_prompts_at_once_not_at_the_polls_end():
    """The learner's new version opens capacity; the dispatcher, blocked in a long poll, is
    woken (`WorkerPool.wake`, via `Admission.on_version`) and hands the prompts out at once."""
    replay, pool, dispatcher = _long_polling_dispatcher()
    with dispatcher:
        handle = _first_batch_delivered(replay, pool)
        pool.finish(handle)  # ends the poll; then the loop blocks in the next 600 s one
        _wait_until(lambda: not dispatcher.handles)
        assert replay.take(2, 0) is not None and replay.capacity() == 0
        replay.set_version(1)  # capacity for version 1's batch, while the dispatcher polls
        _wait_until(lambda: len(pool.submissions) == 2)
    assert pool.submissions[1] == (0, ["p2", "p3"])
    assert pool.wake not in replay.admission.on_version  # a stopped dispatcher unhooks


def test_opened_capacity_is_handed_out_before_open_capacity_returns():
    """The loop opens a new version's capacity through `open_capacity`, which returns only once
    the dispatcher has run a round since (so the loop's own bookkeeping runs after the prompts
    are on their way, not before them)."""
    replay, pool, dispatcher = _long_polling_dispatcher()
    with dispatcher:
        handle = _first_batch_delivered(replay, pool)
        _wait_until(lambda: pool.waiting)
        polls = pool.polls
        pool.finish(handle)  # ends that poll; the round after it ends in the next long poll
        _wait_until(lambda: pool.polls > polls and pool.waiting)
        assert replay.take(2, 0) is not None and replay.capacity() == 0
        assert dispatcher.open_capacity(lambda: replay.set_version(1), timeout_s=30.0)
        assert pool.submissions[1] == (0, ["p2", "p3"])  # handed out already: no waiting here
        # nothing new to hand out: the wait ends at its bound, nothing else happens
        assert not dispatcher.open_capacity(lambda: None, timeout_s=0.05)
        assert len(pool.submissions) == 2


def _long_polling_dispatcher() -> tuple[ReplayQueue, FakePool, Dispatcher]:
    """A synchronous run's dispatcher (batches of 2) over one worker, whose polls only a wake
    can end within a test's deadline (600 s)."""
    replay = ReplayQueue(ReplayConfig(max_staleness=0, rollout_batch_size=2))
    next_prompt, _ = prompts()
    pool = FakePool(1)
    dispatcher = Dispatcher(pool, replay, next_prompt, max_inflight_per_worker=4)
    dispatcher.poll_s = 600.0
    return replay, pool, dispatcher


def _first_batch_delivered(replay: ReplayQueue, pool: FakePool) -> int:
    """Version 0's batch (2 prompts) handed out and its groups delivered; its handle."""
    _wait_until(lambda: len(pool.submissions) == 1)
    ((handle, items),) = pool.started()
    for it in items:
        replay.put(group_for(it.key, 0))
    return handle


def _wait_until(ready, deadline_s: float = 30.0) -> None:
    """Poll `ready()` to a deadline (the dispatcher thread gives no event to wait on)."""
    deadline = time.monotonic() + deadline_s
    while not ready():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.005)

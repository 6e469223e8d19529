"""Replay queue: staleness bound, AReaL admission capacity, filters, checkpoint, threads."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.replay import (
    DuplicateGroupError,
    ReplayConfig,
    ReplayError,
    ReplayQueue,
    build_filters,
    dapo_zero_variance,
    length_filter,
    staleness,
)
from asyncrl.types import NOT_GENERATED, TrajectoryGroup


def group(
    gid: str,
    version: int | Sequence[int] = 0,
    rewards: Sequence[float] = (0.0, 1.0),
    length: int = 3,
    finish: str | Sequence[str] = "stop",
) -> TrajectoryGroup:
    """A hand-built group; `version` is one version for every token, or one per response."""
    n = len(rewards)
    versions = [version] * n if isinstance(version, int) else list(version)
    finishes = [finish] * n if isinstance(finish, str) else list(finish)
    responses = [
        {
            "response_ids": np.arange(length) + 10,
            "rollout_logprobs": np.full(length, -0.5),
            "versions": np.full(length, versions[i]),
            "reward": rewards[i],
            "finish_reason": finishes[i],
        }
        for i in range(n)
    ]
    return TrajectoryGroup.from_responses(gid, [1, 2, 3], responses)


def ids(groups: Sequence[TrajectoryGroup] | None) -> list[str]:
    assert groups is not None
    return [g.group_id for g in groups]


def q(max_staleness: int = 0, batch: int = 1, version: int = 0, **kw) -> ReplayQueue:
    cfg = ReplayConfig(max_staleness=max_staleness, rollout_batch_size=batch, **kw)
    return ReplayQueue(cfg, version=version)


def keys(k: int, prefix: str = "r") -> list[str]:
    """k prompt keys for `reserve`: `prefix0` ... `prefix{k-1}`."""
    return [f"{prefix}{i}" for i in range(k)]


def evicted(queue: ReplayQueue) -> list[str]:
    """Ids of the recently evicted groups, as the checkpoint keeps them."""
    return queue.state_dict()["evicted_ids"]


def in_flight(queue: ReplayQueue) -> list[str]:
    """Keys in the in-flight ledger, in re-issue order."""
    return [p["key"] for p in queue.admission.outstanding()]


# -- config ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        {"max_staleness": -1},
        {"rollout_batch_size": 0},
        {"dedup_window": -1},
        {"filters": ["not callable"]},
    ],
)
def test_bad_config_is_one_clear_error(kw):
    with pytest.raises(ReplayError, match="replay"):
        ReplayConfig(**kw)


# -- take: FIFO and staleness ---------------------------------------------------------------
def test_take_is_fifo_oldest_first_and_none_when_short():
    queue = q(max_staleness=10, version=5)
    for i in range(5):
        queue.put(group(f"g{i}", version=5))
    assert queue.take(6, 5) is None
    assert len(queue) == 5  # a short take consumes nothing
    assert ids(queue.take(2, 5)) == ["g0", "g1"]
    assert ids(queue.take(3, 5)) == ["g2", "g3", "g4"]
    assert queue.take(1, 5) is None
    assert queue.take(0, 5) == []


def test_take_evicts_groups_staler_than_the_bound():
    queue = q(max_staleness=1, batch=8)
    queue.put(group("v0", 0))
    queue.put(group("mixed", [1, 3]))  # min_version is the oldest token's: 1
    queue.put(group("v2", 2))
    queue.put(group("v3", 3))
    assert ids(queue.take(2, current_version=3)) == ["v2", "v3"]
    assert evicted(queue) == ["v0", "mixed"]
    m = queue.metrics()
    assert m["evicted"] == 2 and m["taken"] == 2 and m["depth"] == 0
    assert m["lag_taken/0"] == m["lag_taken/1"] == 1 and m["lag_taken_mean"] == 0.5


def test_set_version_evicts_eagerly_and_stale_puts_are_evicted():
    queue = q(max_staleness=1, batch=4)
    queue.put(group("old", 0))
    queue.put(group("new", 1))
    queue.set_version(2)
    assert evicted(queue) == ["old"] and len(queue) == 1
    assert queue.put(group("late", 0)) is False  # generated two versions ago: evicted on arrival
    assert evicted(queue) == ["old", "late"]
    assert queue.metrics()["evicted"] == 2
    with pytest.raises(ReplayError, match="went back"):
        queue.set_version(1)


def test_group_without_generated_tokens_has_staleness_zero():
    g = TrajectoryGroup.from_responses(
        "env-only",
        [1],
        [
            {
                "response_ids": [7, 8],
                "rollout_logprobs": [0.0, 0.0],
                "versions": [NOT_GENERATED] * 2,
                "loss_mask": [0, 0],
                "reward": 1.0,
                "finish_reason": "stop",
            }
        ],
    )
    assert staleness(g, 100) == 0
    queue = q(max_staleness=0, version=100)
    assert queue.put(g) is True
    assert ids(queue.take(1, 100)) == ["env-only"]


# -- admission capacity ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("s", "v", "b", "accepted", "running"),
    [
        (0, 0, 4, 0, 0),
        (0, 0, 4, 2, 1),
        (0, 0, 4, 0, 9),  # asks for more than the budget: granted only 4
        (2, 3, 8, 10, 5),
        (1, 5, 1, 3, 2),
        (3, 0, 2, 8, 0),
        (0, 2, 4, 13, 0),  # unreserved puts pushed accepted over the budget: clamped to 0
        (4, 10, 16, 100, 50),
    ],
)
def test_capacity_matches_areal_closed_form(s, v, b, accepted, running):
    queue = q(max_staleness=s, batch=b, version=v)
    for i in range(accepted):
        queue.put(group(f"g{i}", v))  # unreserved: accepted without running
    budget = (s + v + 1) * b
    granted = queue.reserve(running, keys(running))
    assert granted == min(running, max(0, budget - accepted))
    assert queue.capacity() == max(0, budget - (accepted + granted))
    m = queue.metrics()
    assert (m["accepted"], m["running"], m["budget"]) == (accepted, granted, budget)


def test_max_staleness_zero_is_synchronous_one_batch_per_version():
    b = 3
    queue = q(max_staleness=0, batch=b)
    for v in range(5):
        queue.set_version(v)
        assert queue.capacity() == b
        assert queue.reserve(b + 2, keys(b + 2, f"v{v}-")) == b  # never more than one batch
        assert queue.capacity() == 0
        for i in range(b):
            queue.put(group(f"v{v}-{i}", v))
        assert queue.take(b + 1, v) is None
        taken = queue.take(b, v)
        assert [staleness(g, v) for g in taken] == [0] * b
        assert queue.capacity() == 0  # nothing more until the learner publishes v+1
    assert queue.metrics()["evicted"] == 0


def test_evictions_free_capacity_so_the_learner_never_starves():
    """Every other prompt is slow (5 ticks) and mostly arrives too stale to train on. The
    budget's slack over what the learner consumes is (s + 1) · b groups; if evicted groups kept
    counting as accepted, more than that many evictions would leave capacity at zero for good
    and the learner would stop. Here it must keep training."""
    s, b = 1, 2
    queue = q(max_staleness=s, batch=b)
    pending: list[tuple[int, str, int]] = []  # (arrival tick, group id, born version)
    serial = 0
    for tick in range(300):
        want = queue.capacity()
        for _ in range(queue.reserve(want, [f"p{serial + i}" for i in range(want)])):
            delay = 5 if serial % 2 else 1
            pending.append((tick + delay, f"p{serial}", queue.version))
            serial += 1
        for arrival in [p for p in pending if p[0] == tick]:
            pending.remove(arrival)
            queue.put(group(arrival[1], arrival[2]))
        if queue.take(b, queue.version) is not None:
            queue.set_version(queue.version + 1)
    m = queue.metrics()
    assert m["evicted"] > 10 * (s + 1) * b
    assert queue.version > 100 and m["taken"] == queue.version * b
    assert m["put"] == m["taken"] + m["evicted"] + m["filtered"] + m["depth"]


def test_filtered_groups_free_capacity():
    queue = q(max_staleness=0, batch=2, filters=(dapo_zero_variance,))
    assert queue.reserve(2, ["flat", "good1"]) == 2
    assert queue.put(group("flat", 0, rewards=(1.0, 1.0))) is False
    assert queue.capacity() == 1  # the filtered prompt is replaced
    assert queue.reserve(5, ["good2", *keys(4)]) == 1
    assert queue.put(group("good1", 0)) and queue.put(group("good2", 0))
    assert ids(queue.take(2, 0)) == ["good1", "good2"]
    assert queue.metrics()["filtered/dapo_zero_variance"] == 1


# -- in-flight ledger -----------------------------------------------------------------------
def test_keyed_reservations_are_cleared_by_put():
    queue = q(max_staleness=0, batch=4)
    assert queue.reserve(3, ["a", "b", "c"]) == 3
    with pytest.raises(ReplayError, match="already in flight"):
        queue.reserve(1, ["a"])
    assert queue.reserve(3, ["d", "e", "f"]) == 1  # only one slot left: "d"
    assert in_flight(queue) == ["a", "b", "c", "d"]
    queue.put(group("a"))  # cleared by group id
    queue.put(group("gid-x"), prompt_key="b")  # cleared by explicit key
    assert in_flight(queue) == ["c", "d"]
    queue.put(group("late"), prompt_key="zzz")  # nobody reserved it: unreserved
    m = queue.metrics()
    assert (m["running"], m["accepted"], m["unreserved"]) == (2, 3, 1)
    with pytest.raises(ReplayError, match="prompt keys"):
        queue.reserve(2, ["only-one"])
    with pytest.raises(ReplayError, match="not a str"):
        queue.reserve(3, "abc")
    with pytest.raises(ReplayError, match="expected a TrajectoryGroup"):
        queue.put({"group_id": "dict"})  # type: ignore[arg-type]


# -- filters --------------------------------------------------------------------------------
def test_dapo_zero_variance():
    assert dapo_zero_variance(group("mixed", rewards=(0.0, 1.0, 1.0)))
    assert not dapo_zero_variance(group("all-right", rewards=(1.0, 1.0, 1.0)))
    assert not dapo_zero_variance(group("all-wrong", rewards=(0.0, 0.0)))
    assert not dapo_zero_variance(group("single", rewards=(0.5,)))


def test_length_filter():
    keep = length_filter(max_response_length=4)
    assert keep.__name__ == "length"
    assert keep(group("short", length=4))
    assert not keep(group("long", length=5))
    assert not keep(group("all-cut", length=2, finish="length"))
    assert keep(group("some-cut", length=2, finish=("length", "stop")))
    assert length_filter(drop_all_truncated=False)(group("all-cut", length=9, finish="length"))
    with pytest.raises(ValueError, match="max_response_length"):
        length_filter(-1)


def test_filters_counted_per_name_and_built_from_specs():
    filters = build_filters(["dapo_zero_variance", {"name": "length", "max_response_length": 3}])
    queue = q(max_staleness=0, batch=10, filters=filters)
    assert not queue.put(group("flat", rewards=(1.0, 1.0)))
    assert not queue.put(group("long", length=9))
    assert not queue.put(group("flat-and-long", rewards=(0.0, 0.0), length=9))  # first filter
    assert queue.put(group("ok"))
    m = queue.metrics()
    assert (m["filtered/dapo_zero_variance"], m["filtered/length"], m["filtered"]) == (2, 1, 3)
    assert m["accepted"] == 1 and m["put"] == 4
    with pytest.raises(ValueError, match="unknown replay filter 'nope'"):
        build_filters(["nope"])
    with pytest.raises(ValueError, match="bad arguments"):
        build_filters([{"name": "length", "max_len": 3}])


# -- duplicates -----------------------------------------------------------------------------
def test_duplicate_group_ids_are_rejected_and_counted():
    queue = q(max_staleness=0, batch=8, filters=(dapo_zero_variance,))
    queue.reserve(1, ["g"])
    queue.put(group("g"))
    queue.reserve(1, ["g"])  # re-issued prompt with the same id
    with pytest.raises(DuplicateGroupError, match="'g' was already put"):
        queue.put(group("g"))
    assert in_flight(queue) == ["g"]  # a rejected duplicate changes nothing
    queue.take(1, 0)
    with pytest.raises(DuplicateGroupError):
        queue.put(group("g"))  # still rejected after it was taken
    queue.put(group("flat", rewards=(1.0, 1.0)))
    with pytest.raises(DuplicateGroupError):
        queue.put(group("flat", rewards=(1.0, 1.0)))  # ... and after it was filtered
    m = queue.metrics()
    assert (m["rejected_duplicates"], m["put"], m["taken"], m["depth"]) == (3, 2, 1, 0)


def test_dedup_window_is_bounded_but_buffered_ids_always_checked():
    queue = q(max_staleness=0, batch=8, dedup_window=2)
    for gid in ("a", "b", "c"):
        queue.put(group(gid))
    with pytest.raises(DuplicateGroupError):
        queue.put(group("a"))  # out of the window but still buffered
    queue.take(3, 0)
    queue.put(group("a"))  # forgotten and gone: accepted again (documented limit)


# -- threads --------------------------------------------------------------------------------
def test_blocking_take_waits_for_puts_and_close_wakes_it():
    queue = q(max_staleness=0, batch=4)
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(queue.take(2, 0, timeout=10)))
    waiter.start()
    queue.put(group("a"))
    queue.put(group("b"))
    waiter.join(10)
    assert ids(result[0]) == ["a", "b"]
    assert queue.take(1, 0, timeout=0.05) is None
    closer = threading.Thread(target=lambda: result.append(queue.take(1, 0, timeout=None)))
    closer.start()
    queue.close()
    closer.join(10)
    assert not closer.is_alive() and result[1] is None


def test_producer_consumer_threads_lose_and_duplicate_nothing():
    s, b, per_producer, producers = 1, 4, 150, 4
    queue = q(max_staleness=s, batch=b, filters=(dapo_zero_variance,))
    stop = threading.Event()
    taken: list[str] = []
    lags: list[int] = []

    def produce(pid: int) -> None:
        made = 0
        while made < per_producer:
            key = f"p{pid}-{made}"
            if not queue.reserve(1, [key]):
                stop.wait(0.0005)
                continue
            born = queue.version
            rewards = (1.0, 1.0) if made % 7 == 0 else (0.0, 1.0)  # some get filtered
            queue.put(group(key, born, rewards=rewards))
            made += 1

    def consume() -> None:
        while not stop.is_set():
            v = queue.version
            batch = queue.take(b, v, timeout=0.01)
            if batch is not None:
                taken.extend(ids(batch))
                lags.extend(staleness(g, v) for g in batch)
                queue.set_version(v + 1)

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(producers)]
    learner = threading.Thread(target=consume)
    for t in [*threads, learner]:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    learner.join(60)
    m = queue.metrics()
    assert len(taken) == len(set(taken)) == m["taken"] > 0
    assert max(lags) <= s
    assert m["put"] == producers * per_producer and m["running"] == 0
    assert m["put"] == m["taken"] + m["evicted"] + m["filtered"] + m["depth"]


# -- checkpoint -----------------------------------------------------------------------------
def _assert_plain(x) -> None:
    if isinstance(x, dict):
        for k, v in x.items():
            assert isinstance(k, str)
            _assert_plain(v)
    elif isinstance(x, list):
        for v in x:
            _assert_plain(v)
    else:
        assert x is None or isinstance(x, (str, int, float, bool, bytes, np.ndarray)), type(x)


def _busy_queue() -> ReplayQueue:
    queue = q(max_staleness=2, batch=3, filters=(dapo_zero_variance,))
    queue.reserve(6, [f"k{i}" for i in range(6)])
    for i, v in enumerate([0, 0, 1, 0]):
        queue.put(group(f"k{i}", v, rewards=(float(i), 0.0) if i else (1.0, 1.0)))
    queue.set_version(2)
    queue.take(1, 2)
    queue.set_version(3)  # evicts k3 (born at 0)
    return queue


def test_state_dict_round_trip_resumes_identically():
    src = _busy_queue()
    state = src.state_dict()
    _assert_plain(state)
    dst = q(max_staleness=2, batch=3, filters=(dapo_zero_variance,))
    dst.load_state_dict(state)
    assert in_flight(dst) == in_flight(src) == ["k4", "k5"]
    assert dst.metrics() == src.metrics()
    assert evicted(dst) == evicted(src) == ["k3"]
    for queue in (src, dst):  # the same future on both
        queue.put(group("k4", 3))
        queue.put(group("k5", 3))
        with pytest.raises(DuplicateGroupError):
            queue.put(group("k1", 3))
    assert ids(src.take(3, 3)) == ids(dst.take(3, 3)) == ["k2", "k4", "k5"]
    assert dst.metrics() == src.metrics()


def test_load_keeps_the_ledger_and_rejects_bad_state():
    src = q(max_staleness=0, batch=4)
    src.reserve(1, ["keyed"])
    dst = q(max_staleness=0, batch=4)
    dst.load_state_dict(src.state_dict())
    assert dst.metrics()["running"] == 1 and dst.capacity() == 3
    before = dst.metrics()
    bad = src.state_dict()
    bad["groups"] = [{"group_id": "x"}]
    for broken in ({"format": 99}, "nope", bad, {**src.state_dict(), "counters": {"taken": 5}}):
        with pytest.raises(ReplayError, match="replay state"):
            dst.load_state_dict(broken)
    assert dst.metrics() == before  # all or nothing


# -- property: random interleavings ---------------------------------------------------------
OPS = st.sampled_from(["reserve", "put", "put", "put_flat", "take", "learner_step", "set_version"])


@settings(max_examples=200, deadline=None)
@given(
    s=st.integers(0, 3),
    b=st.integers(1, 4),
    steps=st.lists(st.tuples(OPS, st.integers(0, 5), st.integers(0, 3)), min_size=10, max_size=100),
)
def test_random_interleavings_keep_the_invariants(s, b, steps):
    cfg = ReplayConfig(s, b, filters=(dapo_zero_variance,))
    queue = ReplayQueue(cfg)
    reserved_at: dict[str, int] = {}  # key -> version when it was reserved
    serial = 0
    for op, k, extra in steps:
        v = queue.version
        if op == "reserve":
            keys = [f"k{serial + i}" for i in range(k)]
            serial += k
            for key in keys[: queue.reserve(k, keys)]:
                reserved_at[key] = v
        elif op in ("put", "put_flat") and reserved_at:
            key = sorted(reserved_at)[k % len(reserved_at)]
            born = min(v, reserved_at.pop(key) + extra)  # tokens from reserve time up to now
            queue.put(group(key, born, rewards=(1.0, 1.0) if op == "put_flat" else (0.0, 1.0)))
        elif op == "take":
            got = queue.take(1 + k % 2, v)
            assert got is None or all(0 <= staleness(g, v) <= s for g in got)
        elif op == "learner_step":  # one batch, then publish new weights
            got = queue.take(b, v)
            if got is not None:
                assert all(0 <= staleness(g, v) <= s for g in got)
                queue.set_version(v + 1)
        elif op == "set_version":
            queue.set_version(v + extra)
        m = queue.metrics()
        assert m["accepted"] + m["running"] <= m["budget"]
        assert m["put"] == m["taken"] + m["evicted"] + m["filtered"] + m["depth"]
        assert m["accepted"] == m["taken"] + m["depth"]
        assert m["running"] == len(reserved_at) == len(in_flight(queue))
        assert m["unreserved"] == 0 and m["capacity"] >= 0

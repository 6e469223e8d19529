"""What becomes of a group staler than max_staleness: evict, wait or correct (replay queue with
its real admission and buffer; only the groups are hand-built)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.replay import ReplayConfig, ReplayError, ReplayQueue
from asyncrl.types import TrajectoryGroup


def group(gid: str, version: int, length: int = 3, n: int = 2) -> TrajectoryGroup:
    responses = [
        {
            "response_ids": np.arange(length) + 10,
            "rollout_logprobs": np.full(length, -0.5),
            "versions": np.full(length, version),
            "reward": float(i % 2),
            "finish_reason": "stop",
        }
        for i in range(n)
    ]
    return TrajectoryGroup.from_responses(gid, [1, 2, 3], responses)


def queue(policy: str, s: int = 1, batch: int = 2, hard: int | None = None) -> ReplayQueue:
    cfg = ReplayConfig(s, batch, stale_policy=policy, max_staleness_hard=hard)
    return ReplayQueue(cfg)


def ids(groups) -> list[str]:
    assert groups is not None
    return [g.group_id for g in groups]


def start(q: ReplayQueue, *keys: str, worker: int = 0) -> None:
    """Admit `keys` and hand them to `worker` at the queue's current version."""
    assert q.reserve(len(keys), list(keys)) == len(keys)
    assert [p["key"] for p in q.admission.issue(worker, len(keys))] == list(keys)


# -- evict: today's behaviour ---------------------------------------------------------------
def test_evict_drops_groups_past_the_bound_and_reopens_their_slots():
    q = queue("evict", s=1, batch=2)
    start(q, "old", "new")
    q.set_version(1)
    q.put(group("old", 0, length=9))
    q.set_version(2)  # "old" is now 2 versions behind: evicted, its slot free again
    assert q.metrics()["evicted"] == 1 and len(q) == 0
    assert q.put(group("new", 2)) is True
    m = q.metrics()
    assert m["generated_length_mean"] == 6.0 and m["taken"] == 0
    assert ids(q.take(1, 2)) == ["new"]
    assert q.metrics()["length_ratio"] == pytest.approx(3 / 6)  # the long one never trained


# -- correct: trained up to the hard cap ----------------------------------------------------
def test_correct_trains_groups_up_to_the_hard_cap_and_evicts_beyond_it():
    q = queue("correct", s=1, batch=3, hard=3)
    for gid, born in (("fresh", 5), ("lag3", 2), ("lag2", 3), ("lag4", 1)):
        q.put(group(gid, born))
    q.set_version(5)
    assert q.metrics()["evicted"] == 1  # lag4 is past the hard cap
    assert q.put(group("lag5", 0)) is False  # past the cap on arrival: evicted too
    # stalest first, so groups past max_staleness are trained before they age further
    assert ids(q.take(3, 5)) == ["lag3", "lag2", "fresh"]
    m = q.metrics()
    assert m["evicted"] == 2 and m["over_bound"] == 2
    assert (m["lag_taken/3"], m["lag_taken/2"], m["lag_taken/0"]) == (1, 1, 1)


def test_correct_keeps_long_responses_so_the_length_ratio_stays_one():
    lengths = {"short": 2, "long": 10}
    by_policy = {}
    for policy, hard in (("evict", None), ("correct", 4)):
        q = queue(policy, s=1, batch=1, hard=hard)
        q.put(group("short", 3, lengths["short"]))
        q.put(group("long", 1, lengths["long"]))  # a long response that came back late
        q.set_version(3)
        taken = [g for _ in range(2) if (g := q.take(1, 3)) is not None]
        by_policy[policy] = (len(taken), q.metrics().get("length_ratio"))
    assert by_policy["evict"] == (1, pytest.approx(2 / 6))
    assert by_policy["correct"] == (2, pytest.approx(1.0))


# -- wait: no new prompt, no learner step while in-flight work would go over ---------------
def test_wait_closes_admission_and_holds_the_learner_until_the_stale_prompt_lands():
    q = queue("wait", s=1, batch=2)
    start(q, "long", "a", "b", "c")  # all started at version 0
    for key in ("a", "b"):
        q.put(group(key, 0))
    assert ids(q.take(2, 0)) == ["a", "b"]
    q.set_version(1)  # "long" started at 0: one more step would make it 2 behind
    q.put(group("c", 0))
    assert q.admission.stale_in_flight() and q.capacity() == 0  # no new prompt starts
    assert q.metrics()["stale_in_flight"] == 1
    assert q.take(1, 1) is None  # the learner waits although a group is ready

    got: list = []
    taker = threading.Thread(target=lambda: got.append(q.take(2, 1, timeout=30)))
    taker.start()
    q.put(group("long", 0, length=12))  # delivery wakes the waiting take
    taker.join(timeout=30)
    assert not taker.is_alive() and ids(got[0]) == ["c", "long"]
    m = q.metrics()
    assert m["evicted"] == 0 and m["stale_in_flight"] == 0 and m["lag_taken/1"] == 2
    assert q.capacity() > 0  # the gate reopened


def test_wait_never_evicts_and_a_failed_worker_prompt_stops_gating():
    q = queue("wait", s=0, batch=1)
    start(q, "p", worker=1)
    q.set_version(3)  # e.g. a restored run: nothing buffered is ever evicted under wait
    assert q.admission.stale_in_flight() and q.take(1, 3) is None
    assert q.admission.requeue(["p"], worker=1) == 1  # pending again: restarts afresh
    assert not q.admission.stale_in_flight()
    q.put(group("late", 0))  # an unreserved straggler from long ago is still trained
    assert ids(q.take(1, 3)) == ["late"] and q.metrics()["evicted"] == 0


def test_wait_issues_at_the_current_version_so_fresh_work_does_not_gate():
    q = queue("wait", s=1, batch=1)
    q.set_version(4)
    start(q, "x")
    assert not q.admission.stale_in_flight()  # started at 4: within the bound at 5
    q.put(group("y", 4))
    assert ids(q.take(1, 4)) == ["y"]


# -- resume with stale groups in the queue --------------------------------------------------
@pytest.mark.parametrize(
    ("policy", "hard", "trained"),
    [
        ("evict", None, ["fresh"]),
        ("correct", 3, ["lag2", "fresh"]),
        ("wait", None, ["lag2", "fresh"]),
    ],
)
def test_resume_with_stale_groups_in_the_queue_follows_the_policy(policy, hard, trained):
    q = queue(policy, s=1, batch=1, hard=hard)
    start(q, "inflight")
    q.put(group("lag2", 1, length=7))
    q.put(group("fresh", 3))
    state = q.state_dict()
    resumed = queue(policy, s=1, batch=1, hard=hard)
    resumed.load_state_dict(state)
    resumed.set_version(3)  # as `run.resume` does, at the checkpoint's version
    got = [ids(resumed.take(1, 3))[0] for _ in range(len(resumed))]
    assert got == trained
    # the in-flight prompt came back pending: it restarts at 3 and gates nothing
    assert [p["key"] for p in resumed.admission.outstanding()] == ["inflight"]
    assert not resumed.admission.stale_in_flight()
    assert resumed.metrics()["generated_length_mean"] == pytest.approx(5.0)


# -- config ---------------------------------------------------------------------------------
def test_bad_replay_config_is_one_clear_error():
    with pytest.raises(ReplayError, match="stale_policy: 'drop'"):
        ReplayConfig(1, 2, stale_policy="drop")
    with pytest.raises(ReplayError, match="max_staleness_hard must be >= max_staleness"):
        ReplayConfig(3, 2, stale_policy="correct", max_staleness_hard=2)


def test_validation_asks_correct_for_sequence_level_is_with_veto():
    ok = [
        "async.stale_policy=correct",
        "async.max_staleness_hard=3",
        "algorithm.rollout_is_level=geometric",
    ]
    cfg = load_config(None, ok)
    assert cfg.async_.stale_policy == "correct" and cfg.async_.max_staleness_hard == 3
    with pytest.raises(ConfigError, match=r"rollout_is_level: sequence\|geometric") as info:
        load_config(None, ["async.stale_policy=correct"])
    assert "\n" not in str(info.value)
    bypass = [*ok, "algorithm.correction_mode=bypass", "algorithm.rollout_is_veto_threshold=null"]
    with pytest.raises(ConfigError, match="bypass.*veto_threshold"):
        load_config(None, bypass)
    with pytest.raises(ConfigError, match="max_staleness_hard \\(0\\) must be >="):
        load_config(None, ["async.stale_policy=correct", "async.max_staleness_hard=0"])
    assert load_config(None, ["async.stale_policy=wait"]).async_.stale_policy == "wait"

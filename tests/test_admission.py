"""Admission alone, without a group in sight: AReaL's capacity rule and the in-flight ledger's
moves (reserve → pending → on worker → in transit → delivered; a failed worker → pending)."""

from __future__ import annotations

import pytest

from asyncrl.replay import Admission, ReplayError


def keys(*names: str) -> list[str]:
    return list(names)


@pytest.mark.parametrize(("s", "v", "b"), [(0, 0, 4), (2, 3, 8), (1, 5, 1)])
def test_budget_is_the_areal_rule_and_deliveries_move_running_to_accepted(s, v, b):
    adm = Admission(max_staleness=s, rollout_batch_size=b, version=v)
    budget = (s + v + 1) * b
    assert adm.budget() == adm.capacity() == budget
    granted = adm.reserve(budget + 3, [f"k{i}" for i in range(budget + 3)])
    assert granted == budget and adm.capacity() == 0
    adm.delivered("k0", accepted=True)  # running → accepted: the sum is unchanged
    adm.delivered("k1", accepted=False)  # filtered or evicted on arrival: its slot opens
    assert adm.capacity() == 1
    adm.dropped(1)  # an accepted group evicted later: its slot opens too
    assert adm.capacity() == 2
    adm.set_version(v + 1)  # one more batch of budget
    assert adm.capacity() == 2 + b
    m = adm.metrics()
    assert (m["running"], m["accepted"], m["unreserved"]) == (budget - 2, 0, 0)
    with pytest.raises(ReplayError, match="went back"):
        adm.set_version(v)


def test_the_ledger_moves_a_prompt_through_its_states():
    adm = Admission(max_staleness=3, rollout_batch_size=2)
    assert adm.reserve(4, keys("a", "b", "c", "d"), [{"key": k, "x": 1} for k in "abcd"]) == 4
    assert adm.pending() == 4 and adm.load(2) == [0, 0]
    assert [p["key"] for p in adm.issue(worker=0, n=3)] == ["a", "b", "c"]  # oldest first
    assert adm.issue(worker=1, n=3) == [{"key": "d", "x": 1}]
    assert adm.load(2) == [3, 1] and adm.pending() == 0
    adm.reported(["a"], worker=0)  # a's group is in transit: the slot frees, still running
    assert adm.load(2) == [2, 1] and adm.running() == 4
    assert adm.requeue(["a", "b", "c", "d"], worker=0) == 2  # only what is on worker 0
    assert [p["key"] for p in adm.outstanding()] == ["b", "c", "a", "d"]  # pending first
    adm.delivered("b", accepted=True)  # a pending prompt's group arrived after all
    assert adm.issue(worker=1, n=5) == [{"key": "c", "x": 1}]
    for key in ("a", "c", "d"):
        adm.delivered(key, accepted=True)
    assert adm.running() == 0 and adm.load(2) == [0, 0] and adm.metrics()["unreserved"] == 0
    adm.delivered("nobody", accepted=True)
    assert adm.metrics()["unreserved"] == 1


def test_state_round_trip_brings_every_outstanding_prompt_back_pending():
    adm = Admission(max_staleness=1, rollout_batch_size=3, version=2)
    adm.reserve(3, keys("a", "b", "c"))
    adm.issue(worker=0, n=2)
    adm.delivered("a", accepted=True)
    state = adm.state_dict()
    assert state["outstanding"] == [{"key": "c"}, {"key": "b"}]
    back = Admission.from_state(1, 3, state)
    assert back.metrics() == adm.metrics() and back.pending() == 2
    with pytest.raises(TypeError):
        Admission.from_state(1, 3, {**state, "outstanding": [{"key": 5}]})


def test_bad_reservations_are_one_clear_error():
    adm = Admission(max_staleness=0, rollout_batch_size=2)
    with pytest.raises(ReplayError, match="k must be >= 0"):
        adm.reserve(-1, [])
    with pytest.raises(ReplayError, match="2 prompt keys for k=1"):
        adm.reserve(1, ["a", "b"])
    with pytest.raises(ReplayError, match="already in flight"):
        adm.reserve(2, ["a", "a"])
    assert adm.running() == 0  # a refused reservation admits nothing

"""A pinned version's lease (`HFEngine(pinned_linger_s=...)`, the hf server's
`--pinned-version-linger-s`): a version a pinned request used less than the lease ago is kept
through a weight change with no request of it in flight, so an episode's next turn, sent only
once the previous one came back, still runs on it; past the lease it goes; room for a newer
version is taken from one that only a lease keeps before one whose requests still run. The
engine is real (a random Qwen2); its clock is a fake one, moved by the test."""

from __future__ import annotations

import copy

import pytest

from asyncrl.engine.hf.engine import HFEngine
from asyncrl.engine.versions import HF_SERVER_VERSION, profile_for
from tests.helpers import random_qwen2
from tests.test_pinned_versions import Done, _between_steps, _change_weights, _reference

LEASE_S = 30.0
SHORT = 4  # tokens of a turn


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _engine(clock: Clock, max_kept: int = 1, lease_s: float = LEASE_S) -> HFEngine:
    engine = HFEngine(
        random_qwen2(), max_batch_size=8, seed=0, max_pinned_versions=max_kept,
        pinned_linger_s=lease_s, clock=clock,
    )  # fmt: skip
    engine.weight_version = "1"
    engine.start()
    return engine


def _turn(engine: HFEngine, done: Done, rid: str, pin: str | None) -> None:
    engine.submit(done.seq(rid, pin, SHORT))
    done.wait(rid)


def test_a_leased_version_serves_the_next_turn_after_a_weight_change_and_goes_past_it():
    clock, done = Clock(), Done()
    engine = _engine(clock)
    original = copy.deepcopy(engine.model)
    try:
        _turn(engine, done, "turn1", "1")  # nothing of version 1 in flight from here on
        _change_weights(engine, "2", seed=1)
        assert engine.kept_versions() == ["1"]
        clock.now += LEASE_S / 2
        _turn(engine, done, "turn2", "1")  # renews the lease
        clock.now += LEASE_S * 0.9  # past the first lease, within the renewed one
        _turn(engine, done, "other", None)  # a step: idle kept versions are dropped after it
        assert engine.kept_versions() == ["1"]
        clock.now += LEASE_S
        _turn(engine, done, "later", None)
        assert engine.kept_versions() == []
        with pytest.raises(ValueError, match="pin_weight_version 1 is not served: it serves 2"):
            engine.submit(done.seq("turn3", "1", SHORT))
    finally:
        engine.stop()
    turn2 = done.seqs["turn2"]
    assert turn2.error is None and set(turn2.token_versions) == {"1"}
    assert turn2.output_ids == _reference(original, SHORT).output_ids  # the kept copy's
    assert done.seqs["other"].weight_version == "2"


def test_without_a_lease_a_version_with_nothing_in_flight_is_not_kept():
    clock, done = Clock(), Done()
    engine = _engine(clock, lease_s=0.0)
    try:
        _turn(engine, done, "turn1", "1")
        _change_weights(engine, "2", seed=1)
        assert engine.kept_versions() == []
        with pytest.raises(ValueError, match="pin_weight_version 1 is not served"):
            engine.submit(done.seq("turn2", "1", SHORT))
    finally:
        engine.stop()


def test_room_is_taken_from_a_version_only_a_lease_keeps_before_one_still_running():
    clock, done = Clock(), Done()
    engine = _engine(clock, max_kept=2)
    try:
        running = done.seq("long", "1")  # runs on version 1 throughout
        engine.submit(running)
        _between_steps(engine, [running], lambda: _change_weights(engine, "2", seed=1))
        _turn(engine, done, "on2", "2")
        _change_weights(engine, "3", seed=2)  # 2: leased, nothing in flight
        _turn(engine, done, "on3", "3")
        assert engine.kept_versions() == ["1", "2"]
        _change_weights(engine, "4", seed=3)  # full: 2 goes, not the older 1
        assert engine.kept_versions() == ["1", "3"]
        done.wait("long")
    finally:
        engine.stop()
    long = done.seqs["long"]
    assert long.error is None and set(long.token_versions) == {"1"}


def test_the_servers_profile_carries_the_lease():
    def linger(info: dict) -> float:
        return profile_for(HF_SERVER_VERSION, info).pinned_linger_s

    assert linger({"pinned_version_linger_s": 5.0}) == 5.0 and linger({}) == 0.0
    for bad in ("5", True, -1.0, float("nan"), float("inf")):
        assert linger({"pinned_version_linger_s": bad}) == 0.0
    with pytest.raises(ValueError, match="pinned_linger_s"):
        HFEngine(random_qwen2(), pinned_linger_s=-1.0)

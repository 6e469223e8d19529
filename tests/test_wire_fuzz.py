"""Fuzz the receive side with hostile but well-formed groups (hypothesis, bounded): through a
real Sender → Receiver → GroupPump → ReplayQueue, whatever mix arrives, the pump lives, every
group the learner can take is one it can train on (token ids inside the vocabulary, no version
from the future, a string prompt key), and every good group around the bad ones arrives, in
order. The safety checks below are written from the definitions, not from `check_group`."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.types import NOT_GENERATED
from tests.test_hostile_wire import VOCAB, Wire, group

pytestmark = pytest.mark.timeout(300)
LEARNER_VERSION = 3
OLDEST_KEPT = LEARNER_VERSION - 2  # the Wire's queue runs with max_staleness 2

keys = st.one_of(
    st.text(min_size=0, max_size=4),
    st.integers(-(2**63), 2**63 - 1),  # what msgpack can carry
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=2),
    st.none(),
    st.floats(allow_nan=True),
)
env_values = st.one_of(st.integers(0, 5), st.floats(0, 5), st.text(max_size=3), st.booleans())
hostile = st.fixed_dictionaries(
    {
        "token": st.integers(0, 2 * VOCAB),
        "prompt": st.integers(0, 2 * VOCAB),
        "version": st.sampled_from([NOT_GENERATED, 0, 1, LEARNER_VERSION, LEARNER_VERSION + 1, 99]),
    },
    optional={"prompt_key": keys, "env/turns": env_values},
)


def trainable(spec: dict) -> bool:
    """From the definitions: ids inside the vocabulary, no future version, a str key."""
    key_ok = "prompt_key" not in spec or (
        isinstance(spec["prompt_key"], str) and spec["prompt_key"]
    )
    env = spec.get("env/turns", 0)
    env_ok = isinstance(env, int | float) and not isinstance(env, bool)
    return (
        spec["token"] < VOCAB
        and spec["prompt"] < VOCAB
        and spec["version"] <= LEARNER_VERSION
        and key_ok
        and env_ok
    )


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(hostile, min_size=1, max_size=6))
def test_hostile_mixes_never_reach_the_learner_and_good_groups_all_arrive(specs):
    with Wire(version=LEARNER_VERSION) as wire:
        good_keys = [f"good-{i}" for i in range(len(specs) + 1)]
        wire.queue.reserve(len(good_keys), good_keys)
        expected = []
        with wire.sender() as tx:
            for i, spec in enumerate(specs):
                tx.send(group(good_keys[i]))
                expected.append(good_keys[i])
                meta = {k: v for k, v in spec.items() if k in ("prompt_key", "env/turns")}
                gid = f"fuzz-{i}"
                tx.send(group(gid, version=spec["version"], token=spec["token"],
                              prompt=spec["prompt"], **meta))  # fmt: skip
                fresh = spec["version"] == NOT_GENERATED or spec["version"] >= OLDEST_KEPT
                if trainable(spec) and fresh:  # a stale one is evicted by the queue, by design
                    expected.append(gid)
            tx.send(group(good_keys[-1]))
            expected.append(good_keys[-1])
            # One pump thread, FIFO: once the last good group is taken, every message before it
            # was handled, so nothing more can arrive.
            arrived = wire.queue.take(len(expected), LEARNER_VERSION, timeout=60)
            assert arrived is not None, f"groups lost: {wire.pump.counters}"
            assert arrived[-1].group_id == good_keys[-1] and len(wire.queue) == 0
        assert wire.pump.error is None and wire.pump._thread.is_alive()
    for g in arrived:  # what the learner can take is trainable, by the definitions
        assert int(g.response_ids.max()) < VOCAB and int(g.prompt_ids.max()) < VOCAB
        assert int(g.versions.max()) <= LEARNER_VERSION
        assert isinstance(g.metadata.get("prompt_key", g.group_id), str)
    arrived_ids = [g.group_id for g in arrived]
    assert [k for k in arrived_ids if k.startswith("good")] == good_keys  # all, in order
    assert sorted(arrived_ids) == sorted(expected)

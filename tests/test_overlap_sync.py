"""`weight_sync.overlap`: a sync that runs while the learner trains on. The orchestrator and the
replay queue are real; the engine fleet (the edge: engine processes) is a stand-in whose syncs
the test completes by hand."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from asyncrl.config import load_config
from asyncrl.config.schema import RolloutConfig, WeightSyncConfig
from asyncrl.orchestrator import Orchestrator
from asyncrl.replay.queue import ReplayConfig, ReplayQueue
from asyncrl.startup import overlap_sync
from asyncrl.weights.sync import WeightSyncError
from tests.test_replay_queue import group, ids


class Learner:
    version = 0


class Fleet:
    """EngineFleet's sync surface: `start_sync` hands back a future the test resolves."""

    def __init__(self) -> None:
        self.ws, self.last_sync = WeightSyncConfig(timeout_s=5), {"sync/seconds": 0.5}
        self.started: list[tuple[int, cf.Future, object]] = []
        self.blocking, self.heals = [], 0

    def start_sync(self, source, copy=True, then=None, eval_engine=True) -> cf.Future:
        assert copy  # the learner trains on: the sync must send a copy
        future: cf.Future = cf.Future()
        self.started.append((source.version, future, then))
        return future

    def land(self, ok: bool = True) -> None:
        """As the control loop does: `then` (admission) first, then the future."""
        _, future, then = self.started[-1]
        if ok:
            then()
            future.set_result({"sync/seconds": 0.25})
        else:
            future.set_exception(WeightSyncError("engine 0 died mid-sync"))

    def sync(self, source, eval_engine=True) -> dict:
        self.blocking.append(source.version)
        return {"sync/seconds": 0.125}

    def heal(self, source) -> bool:
        self.heals += 1
        return True


class Quiet:
    """The dispatcher's and the pump's surface: nothing has gone wrong with them; new capacity
    is opened (handing it out is `test_dispatch`'s)."""

    last_error = None

    def check(self) -> None:
        pass

    def diagnosis(self) -> str:
        return ""

    def open_capacity(self, opening, timeout_s: float) -> bool:
        opening()
        return True


@pytest.fixture()
def parts():
    queue = ReplayQueue(ReplayConfig(max_staleness=1, rollout_batch_size=2))
    fleet, learner = Fleet(), Learner()
    rollout = Orchestrator(RolloutConfig(), fleet, Quiet(), Quiet(), queue, learner, overlap=True)
    return rollout, fleet, learner, queue


def test_admission_opens_when_the_overlapped_sync_lands_not_before(parts):
    rollout, fleet, learner, queue = parts
    learner.version = 1
    assert rollout.sync_weights(overlap=True) == {}  # returns at once: nothing landed yet
    rollout.open_admission(1)
    assert queue.admission.budget() == 2 * 2  # still version 0's: the engines hold 0
    fleet.land()  # the control loop: every engine holds 1
    assert queue.admission.budget() == 3 * 2
    learner.version = 2  # the next step trained meanwhile; its sync lands the last one
    assert rollout.sync_weights(overlap=True) == {"sync/seconds": 0.25, "sync/overlapped": 1.0}
    assert [v for v, _, _ in fleet.started] == [1, 2] and fleet.blocking == []
    # a step that evaluates waits for its own sync, after the one in flight landed
    fleet.land()
    learner.version = 3
    assert rollout.sync_weights(overlap=False) == {"sync/seconds": 0.125}
    assert fleet.blocking == [3]
    rollout.open_admission(3)
    assert queue.admission.budget() == 5 * 2


def test_a_later_version_or_a_checkpoint_lands_the_sync_in_flight(parts):
    rollout, fleet, learner, queue = parts
    learner.version = 1
    rollout.sync_weights(overlap=True)
    fleet.land()
    rollout.open_admission(2)  # sync_interval > 1: a step without a sync lands it first
    assert queue.admission.budget() == 4 * 2
    learner.version = 3
    rollout.sync_weights(overlap=True)
    fleet.land()
    state = rollout.state_dict()  # a checkpoint: the queue at the learner's version
    assert state["queue"]["version"] == 3


def test_an_overlapped_sync_that_fails_heals_at_its_landing_and_opens_admission(parts):
    rollout, fleet, learner, queue = parts
    learner.version = 1
    rollout.sync_weights(overlap=True)
    fleet.land(ok=False)
    learner.version = 2
    landed = rollout.sync_weights(overlap=True)
    assert fleet.heals == 1 and landed == {"sync/seconds": 0.5, "sync/overlapped": 1.0}
    assert queue.admission.budget() == 3 * 2  # version 1's, opened after the heal


def test_a_failed_overlapped_sync_heals_while_the_loop_waits_for_a_batch(parts):
    """The engine died with a sync in flight: no group can come until the fleet heals, so the
    loop, waiting for its next batch, lands the failed sync (which heals) at once instead of
    waiting out `take_batch`'s deadline (the old loop healed only once a batch had come)."""
    rollout, fleet, learner, queue = parts
    rollout.rollout = RolloutConfig(request_timeout_s=3.0)  # the deadline: 6 s

    def heal(source) -> bool:  # called at every wait: relaunches (once) what is dead
        dead, fleet.dead = fleet.dead, False
        if dead:
            fleet.heals += 1
            for gid in ("a", "b"):  # the relaunched engine generates again
                queue.put(group(gid, version=1))
        return dead

    fleet.heal = heal
    learner.version = 1
    rollout.sync_weights(overlap=True)
    fleet.land(ok=False)  # the engine died mid-sync
    fleet.dead = True
    assert ids(rollout.take_batch(2, 1)) == ["a", "b"] and fleet.heals == 1
    assert queue.admission.budget() == 3 * 2  # version 1's, opened after the heal
    learner.version = 2  # the next sync reports the healed one
    assert rollout.sync_weights(overlap=True) == {"sync/seconds": 0.5, "sync/overlapped": 1.0}


def test_overlap_needs_the_run_to_allow_it(parts):
    rollout, fleet, learner, _ = parts
    rollout.overlap = False  # weight_sync.overlap resolved to never
    learner.version = 1
    assert rollout.sync_weights(overlap=True) == {"sync/seconds": 0.125}
    assert fleet.started == [] and fleet.blocking == [1]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], False),  # max_staleness 1: overlapping measured slower
        (["async.max_staleness=2"], True),
        (["async.max_staleness=2", "async.stale_policy=wait"], False),
        (["async.max_staleness=2", "actor_train.device_mapping=[0,1]"], False),
        (["weight_sync.overlap=always"], True),
        (["async.max_staleness=3", "weight_sync.overlap=never"], False),
    ],
)
def test_auto_overlaps_a_one_process_cpu_learner_from_max_staleness_2(overrides, expected):
    assert overlap_sync(load_config(None, overrides)) is expected

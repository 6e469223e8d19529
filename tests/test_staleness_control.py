"""The adaptive staleness bound (`async.max_staleness: auto`): the controller's decisions on
synthetic streams of the learner's ESS-by-lag metrics, and the replay queue applying them."""

from __future__ import annotations

import pytest

from asyncrl.checkpoint import dump_msgpack, load_msgpack
from asyncrl.config import ConfigError, load_config
from asyncrl.replay import ControlSettings, ReplayConfig, ReplayQueue, StalenessController
from asyncrl.run import make_queue
from asyncrl.types import TrajectoryGroup

TARGET = 0.7


def step(
    ess: dict[int, float] | None = None, units: int = 64, signal: str = "sequence"
) -> dict[str, float]:
    """One learner step's metrics as `lag_metrics` names them (and some unrelated keys): the
    ESS by lag of `signal` (the default: the sequence ratios')."""
    out = {"actor/pg_loss": 0.1, "mismatch/rollout_is_eff_sample_size": 0.9}
    name = {"sequence": "seq_", "weights": ""}[signal]
    for lag, value in (ess or {}).items():
        out[f"is/{name}ess_by_lag/{lag}"], out[f"is/{name}units_by_lag/{lag}"] = value, units
    return out


def controller(hard: int = 4, start: int = 1, **kw) -> StalenessController:
    return StalenessController(ControlSettings(hard, TARGET, start=start, **kw))


def run(ctl: StalenessController, stream: list[dict[str, float]]) -> list[int]:
    """The bound after each step."""
    return [ctl.observe(m).bound for m in stream]


def test_relaxes_one_step_after_m_healthy_steps_up_to_the_hard_bound():
    ctl = controller(hard=3, start=1, relax_after=4)
    bounds = run(ctl, [step({1: 0.95})] * 14)
    assert bounds == [1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3]  # never past hard


def test_steps_without_a_stale_group_count_as_healthy():
    ctl = controller(start=0, relax_after=2)  # at bound 0 nothing stale is trained
    assert run(ctl, [step({0: 0.2})] * 2) == [0, 1]  # lag 0's mismatch is not staleness's


def test_tightens_at_once_below_the_lowest_breaking_lag_after_k_steps():
    ctl = controller(hard=4, start=4, tighten_after=2)
    healthy_then_broken = {1: 0.9, 2: 0.8, 3: 0.5, 4: 0.3}
    decisions = [ctl.observe(step(healthy_then_broken)) for _ in range(2)]
    assert [d.bound for d in decisions] == [4, 2]  # one breaking step is not enough
    assert decisions[1].change == -2 and decisions[1].signal == 0.3
    assert decisions[1].reason == (
        "staleness bound tightened 4 -> 2: sequence-ratio ESS at lag 3 0.500 < target 0.7 for 2 "
        "step(s)"
    )
    # a breach at a lag within the bound lowers it by at least one, down to 0
    ctl = controller(hard=4, start=1, tighten_after=1)
    assert run(ctl, [step({1: 0.1})]) == [0]
    assert run(ctl, [step({1: 0.1})] * 3) == [0, 0, 0]  # the floor; lag 1 is not read at 0


def test_a_breach_must_last_k_consecutive_steps():
    ctl = controller(start=2, tighten_after=3, relax_after=50)
    noisy = [step({2: 0.5}), step({2: 0.5}), step({2: 0.9})] * 3  # never 3 in a row
    assert set(run(ctl, noisy)) == {2}
    assert run(ctl, [step({2: 0.5})] * 3)[-1] == 1


def test_only_admitted_lags_with_enough_units_are_read():
    ctl = controller(start=2, tighten_after=1, min_units=8)
    assert run(ctl, [step({3: 0.1, 4: 0.1})]) == [2]  # stragglers past the bound: not read
    assert run(ctl, [step({2: 0.1}, units=7)]) == [2]  # too few units to mean anything
    nan = step({2: float("nan")})
    assert ctl.observe(nan).signal is None and ctl.bound == 2
    assert run(ctl, [step({2: 0.1}, units=8)]) == [1]


def test_a_failed_relax_doubles_the_wait_and_a_held_one_resets_it():
    ctl = controller(hard=4, start=1, tighten_after=1, relax_after=2, max_backoff=4)
    fine, bad_at_2 = step({1: 0.9}), step({1: 0.9, 2: 0.4})
    assert run(ctl, [fine, fine]) == [1, 2]  # relaxed to 2
    assert run(ctl, [bad_at_2]) == [1]  # lag 2 cannot be afforded: the relax failed
    assert run(ctl, [fine] * 4) == [1, 1, 1, 2]  # the wait doubled to 4
    assert run(ctl, [bad_at_2]) == [1]
    assert run(ctl, [fine] * 8) == [1] * 7 + [2]  # 8: the cap (relax_after x max_backoff)
    assert run(ctl, [bad_at_2]) == [1]
    assert run(ctl, [fine] * 8)[-1] == 2  # still capped at 8
    assert run(ctl, [fine] * 8) == [2] * 7 + [3]  # lag 2 held: the next relax after 8 ...
    assert run(ctl, [fine] * 2) == [3, 4]  # ... and then the short wait again


def test_steps_below_target_stay_bounded_when_the_policy_moves_fast():
    """A fast-moving policy: ESS falls with lag (0.85^k). The controller settles where the
    target holds; a breach never lasts more than `tighten_after` steps, and once the back-off
    is capped a probe of the looser bound costs 2 steps in every 34."""
    ctl = controller(hard=4, start=4, tighten_after=2, relax_after=4, max_backoff=8)
    below, bounds = [], []
    for _ in range(400):
        ess = {k: 0.85**k for k in range(1, ctl.bound + 1)}
        below.append(any(v < TARGET for v in ess.values()))
        bounds.append(ctl.observe(step(ess)).bound)
    assert max(bounds[10:]) <= 3 and bounds[-1] == 2  # 0.85^2 = 0.72 holds, 0.85^3 does not
    runs = "".join("x" if b else "." for b in below).split(".")
    assert max(len(r) for r in runs) == 2  # tightened on the breach's second step, always
    assert sum(below[100:]) <= 2 * (300 // 34 + 1)


def test_the_state_round_trips_through_a_checkpoint(tmp_path):
    ctl = controller(hard=4, start=1, tighten_after=1, relax_after=2)
    run(ctl, [step({1: 0.9})] * 2 + [step({1: 0.9, 2: 0.4})] + [step({1: 0.9})] * 3)
    path = tmp_path / "ctl.msgpack"
    dump_msgpack(ctl.state_dict(), path)
    back = controller(hard=4, start=1, tighten_after=1, relax_after=2)
    back.load_state_dict(load_msgpack(path))
    assert back.state_dict() == ctl.state_dict()
    stream = [step({1: 0.9})] * 6 + [step({1: 0.9, 2: 0.3})] * 2
    assert run(back, stream) == run(ctl, stream)  # the same decisions from here on
    lower = controller(hard=2)
    lower.load_state_dict({**ctl.state_dict(), "bound": 4})  # a resumed run with a lower cap
    assert lower.bound == 2
    for bad in ({"bound": -1}, {"last": 5}, {"bound": "x"}):
        with pytest.raises((ValueError, TypeError)):
            controller().load_state_dict({**ctl.state_dict(), **bad})
    with pytest.raises(KeyError):
        controller().load_state_dict({"bound": 1})


def test_bad_settings_are_one_clear_error():
    with pytest.raises(ValueError, match="target_ess must be in"):
        ControlSettings(4, 1.5)
    with pytest.raises(ValueError, match="relax_after must be >= 1"):
        ControlSettings(4, 0.5, relax_after=0)


# -- the queue applies the bound --------------------------------------------------------------
def group(gid: str, version: int) -> TrajectoryGroup:
    responses = [
        {"response_ids": [3, 4], "rollout_logprobs": [-0.5, -0.5], "versions": [version] * 2,
         "reward": float(i), "finish_reason": "stop"}
        for i in range(2)
    ]  # fmt: skip
    return TrajectoryGroup.from_responses(gid, [1, 2], responses)


def auto_queue(policy: str = "evict", start: int = 2, **kw) -> ReplayQueue:
    settings = ControlSettings(4, TARGET, start=start, tighten_after=1, relax_after=2, **kw)
    cfg = ReplayConfig(start, 2, stale_policy=policy, max_staleness_hard=4, control=settings)
    return ReplayQueue(cfg)


def test_the_queue_applies_a_new_bound_to_admission_and_eviction_at_once():
    q = auto_queue("evict", start=2)
    q.set_version(3)
    assert q.metrics()["budget"] == (2 + 3 + 1) * 2
    for gid, born in (("lag2", 1), ("lag1", 2), ("lag0", 3)):
        q.put(group(gid, born))
    decision = q.observe(step({1: 0.9, 2: 0.2}))
    assert decision.bound == 1 and decision.change == -1
    m = q.metrics()
    assert m["staleness_bound"] == 1 and m["budget"] == (1 + 3 + 1) * 2
    assert m["evicted"] == 1 and len(q) == 2  # lag2 is past the new bound: evicted, replaced
    q.observe(step({1: 0.9}))
    assert q.observe(step({1: 0.9})).bound == 2  # relaxed: admission opens again
    assert q.metrics()["budget"] == (2 + 3 + 1) * 2


@pytest.mark.parametrize(("policy", "trained"), [("correct", 2), ("wait", 2)])
def test_correct_and_wait_keep_groups_started_under_the_looser_bound(policy, trained):
    q = auto_queue(policy, start=3)
    q.set_version(3)
    q.put(group("lag3", 0))
    q.put(group("lag0", 3))
    q.observe(step({1: 0.9, 2: 0.2}))  # bound 3 -> 1
    assert q.bound == 1 and len(q) == trained  # nothing evicted under correct (hard 4) or wait
    assert q.take(2, 3) is not None and q.metrics()["over_bound"] == 1  # past the bound now


def test_a_fixed_bound_has_no_controller():
    q = ReplayQueue(ReplayConfig(1, 2))
    assert q.observe(step({1: 0.1})) is None and q.bound == 1


def test_the_queue_checkpoints_the_controller_with_its_groups():
    q = auto_queue("evict", start=3)
    q.observe(step({1: 0.9, 2: 0.9, 3: 0.2}))  # 3 -> 2
    q.observe(step({1: 0.9}))
    state = q.state_dict()
    assert state["staleness_control"]["bound"] == 2 and state["staleness_control"]["healthy"] == 1
    resumed = auto_queue("evict", start=3)
    resumed.load_state_dict(state)
    assert resumed.bound == 2 and resumed.metrics()["budget"] == q.metrics()["budget"]
    assert resumed.observe(step({1: 0.9})).bound == 3  # the healthy streak went on
    fixed = ReplayQueue(ReplayConfig(1, 2)).state_dict()  # saved by a run with a fixed bound
    fresh = auto_queue("evict", start=3)
    fresh.load_state_dict(fixed)
    assert fresh.bound == 3  # the controller starts afresh


def test_config_auto_builds_the_controller_and_is_refused_without_is_weights():
    cfg = load_config(None, ["async.max_staleness=auto", "async.target_ess=0.8"])
    q = make_queue(cfg)
    assert q.controller is not None and q.controller.s == ControlSettings(4, 0.8)
    assert q.bound == 1 and q.config.max_staleness_hard == 4
    assert make_queue(load_config(None, ["async.max_staleness=2"])).controller is None
    refusals = {
        "max_staleness_hard, which is 0: set it >= 1": ["async.max_staleness_hard=0"],
        "target_ess must be in": ["async.target_ess=0"],
        "does not compute": ["algorithm.rollout_is_threshold=null"],
        "correction_mode: decoupled": ["algorithm.correction_mode=bypass"],
    }
    for message, extra in refusals.items():
        with pytest.raises(ConfigError, match=message) as info:
            load_config(None, ["async.max_staleness=auto", *extra])
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="expected int or 'auto'"):
        load_config(None, ["async.max_staleness=sometimes"])
    # correct's ceiling check compares numbers only: auto stays within max_staleness_hard
    ok = ["async.stale_policy=correct", "algorithm.rollout_is_level=geometric"]
    assert load_config(None, [*ok, "async.max_staleness=auto"]).async_.max_staleness == "auto"


def test_the_docstrings_state_the_controller_defaults():
    from asyncrl.config import docs
    from asyncrl.config.schema import AsyncConfig

    def doc(key: str) -> str:
        return " ".join(docs.find(key).doc.split())

    s, text = ControlSettings(4), doc("async.max_staleness")
    assert f"starts at {s.start}" in text and f"for {s.tighten_after} steps" in text
    assert f"after {s.relax_after} steps" in text
    assert f"up to {s.relax_after * s.max_backoff} steps" in text
    assert f"holds {s.min_units} units" in doc("async.target_ess")
    assert s.target_ess == AsyncConfig().target_ess


# -- the KL signal (`async.target_kl`) ---------------------------------------------------------
def kl_step(ess: dict[int, float], kl: dict[int, float], units: int = 64) -> dict[str, float]:
    out = step(ess, units)
    out.update({f"is/kl_by_lag/{lag}": value for lag, value in kl.items()})
    return out


def test_a_lag_whose_kl_stays_above_target_tightens_though_its_ess_holds():
    """Geometric-mean weights keep an ESS near 1 while the policy moves: the KL target sees it."""
    ctl = controller(hard=4, start=4, tighten_after=2, target_kl=0.01)
    moved = kl_step({1: 0.99, 2: 0.99, 3: 0.98, 4: 0.97}, {1: 0.002, 2: 0.006, 3: 0.012, 4: 0.02})
    decisions = [ctl.observe(moved) for _ in range(2)]
    assert [d.bound for d in decisions] == [4, 2]
    assert decisions[1].reason == (
        "staleness bound tightened 4 -> 2: KL at lag 3 0.012 > target 0.01 for 2 step(s)"
    )
    # without a KL target the same stream never moves it (the ESS signal alone)
    assert set(run(controller(hard=4, start=4, tighten_after=2), [moved] * 6)) == {4}


def test_the_lowest_lag_off_either_target_decides_and_relaxing_needs_both():
    ctl = controller(hard=4, start=4, tighten_after=1, target_kl=0.01)
    both = kl_step({1: 0.99, 2: 0.5, 3: 0.99}, {1: 0.001, 2: 0.001, 3: 0.05})
    assert run(ctl, [both]) == [1]  # lag 2's ESS breaks first (below lag 3's KL)
    ctl = controller(hard=3, start=1, relax_after=2, target_kl=0.01)
    assert run(ctl, [kl_step({1: 0.99}, {1: 0.02})] * 2) == [1, 0]  # off KL target: down
    ctl = controller(hard=3, start=1, relax_after=2, target_kl=0.01)
    relaxed = [ctl.observe(kl_step({1: 0.99}, {1: 0.005})) for _ in range(2)]
    assert [d.bound for d in relaxed] == [1, 2]
    assert relaxed[1].reason.endswith("(lowest ESS 0.990, sequence ESS target 0.7, KL target 0.01)")


def test_kl_is_read_for_admitted_lags_with_enough_units_only():
    ctl = controller(start=2, tighten_after=1, min_units=8, target_kl=0.01)
    assert run(ctl, [kl_step({}, {3: 1.0, 4: 1.0})]) == [2]  # past the bound: not read
    assert run(ctl, [kl_step({2: 0.99}, {2: 1.0}, units=7)]) == [2]  # too few units
    assert run(ctl, [kl_step({2: 0.99}, {2: float("inf")})]) == [2]  # not finite: not read
    assert run(ctl, [kl_step({2: 0.99}, {2: 1.0})]) == [1]


def test_target_kl_is_checked_where_it_is_set():
    with pytest.raises(ValueError, match="target_kl must be > 0"):
        ControlSettings(4, TARGET, target_kl=0.0)
    auto = ["async.max_staleness=auto"]
    assert load_config(None, [*auto, "async.target_kl=0.01"]).async_.target_kl == 0.01
    with pytest.raises(ConfigError, match=r"async.target_kl must be > 0"):
        load_config(None, [*auto, "async.target_kl=-1"])
    with pytest.raises(ConfigError, match=r"async.target_kl steers max_staleness: auto"):
        load_config(None, ["async.max_staleness=2", "async.target_kl=0.01"])
    q = make_queue(load_config(None, [*auto, "async.target_kl=0.02"]))
    assert q.controller.s.target_kl == 0.02  # what the run's queue steers by


# -- which ESS is read (`async.staleness_signal`) ---------------------------------------------
def test_the_default_reads_the_sequence_ratios_and_weights_the_loss_weights():
    """The premise workload's picture: geometric-mean weights keep an ESS of 0.98 at lag 4
    while the sequence ratios' ESS is 0.4; each signal reads its own keys only."""
    both = {**step({1: 0.98, 4: 0.98}, signal="weights"), **step({1: 0.95, 4: 0.4})}
    ctl = controller(hard=4, start=4, tighten_after=2)
    decisions = [ctl.observe(both) for _ in range(2)]
    assert [d.bound for d in decisions] == [4, 3] and decisions[1].signal == 0.4
    assert "sequence-ratio ESS at lag 4 0.400 < target 0.7" in decisions[1].reason
    weights = controller(hard=4, start=4, tighten_after=2, signal="weights")
    assert set(run(weights, [both] * 6)) == {4}
    assert weights.observe(both).signal == 0.98
    assert run(controller(start=2, tighten_after=1), [step({2: 0.1}, signal="weights")]) == [2]


def test_each_signal_counts_its_own_units():
    # sequence: rows (`is/seq_units_by_lag`); weights: tokens or rows per IS level
    few_rows = {**step({2: 0.1}, units=7), **step({2: 0.9}, units=500, signal="weights")}
    few_rows["is/units_by_lag/2"] = 500.0
    assert run(controller(start=2, tighten_after=1, min_units=8), [few_rows]) == [2]
    weights = controller(start=2, tighten_after=1, min_units=8, signal="weights")
    assert run(weights, [{**few_rows, "is/ess_by_lag/2": 0.1}]) == [1]


def test_staleness_signal_reaches_the_controller_and_is_checked():
    with pytest.raises(ValueError, match="signal must be one of"):
        ControlSettings(4, TARGET, signal="token")
    auto = ["async.max_staleness=auto"]
    assert make_queue(load_config(None, auto)).controller.s.signal == "sequence"
    q = make_queue(load_config(None, [*auto, "async.staleness_signal=weights"]))
    assert q.controller.s.signal == "weights"
    with pytest.raises(ConfigError, match="async.staleness_signal: 'tokens' is not one of"):
        load_config(None, [*auto, "async.staleness_signal=tokens"])
    with pytest.raises(ConfigError, match=r"async.staleness_signal steers max_staleness: auto"):
        load_config(None, ["async.max_staleness=2", "async.staleness_signal=weights"])


def test_lags_are_read_over_the_lag0_floor_no_bound_changes():
    """Engine/learner numerics alone give lag 0 an ESS of 0.5 (long responses): lag 1 at 0.4
    is 0.8 of that, on target; without the floor every bound would look off target."""
    ctl = controller(hard=4, start=1, tighten_after=1, relax_after=2)
    decisions = [ctl.observe(step({0: 0.5, 1: 0.4})) for _ in range(2)]
    assert ctl.floor == pytest.approx(0.5) and [d.bound for d in decisions] == [1, 2]
    assert decisions[1].signal == pytest.approx(0.8)
    broken = ctl.observe(step({1: 0.4, 2: 0.3}))  # 0.6 of the floor at lag 2: off target
    assert broken.bound == 1 and "over lag 0's 0.500 at lag 2 0.600 < target 0.7" in broken.reason
    # the floor is the mean of the lag-0 ESS measured so far; too few units or NaN: not read
    for ess, units in ((0.9, 64), (0.1, 7), (float("nan"), 64)):
        ctl.observe(step({0: ess}, units=units))
    assert ctl.floor == pytest.approx((0.5 + 0.5 + 0.9) / 3)
    assert controller().floor == 1.0  # nothing measured: the ESS as it is


def test_the_floor_round_trips_and_an_older_state_starts_it_afresh():
    ctl = controller(tighten_after=1)
    run(ctl, [step({0: 0.6, 1: 0.9})] * 3)
    back = controller(tighten_after=1)
    back.load_state_dict(ctl.state_dict())
    assert back.floor == pytest.approx(0.6) and back.state_dict() == ctl.state_dict()
    older = {k: v for k, v in ctl.state_dict().items() if not k.startswith("floor")}
    fresh = controller(tighten_after=1)
    fresh.load_state_dict(older)
    assert fresh.floor == 1.0 and fresh.bound == ctl.bound
    with pytest.raises(ValueError, match="out of range"):
        controller().load_state_dict({**ctl.state_dict(), "floor_sum": 5.0})

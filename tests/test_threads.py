"""The CPU thread budget (`threads`): how the usable cores are split between the learner ranks
and the local engine servers (a pure function), what a config may ask for, and that a launched
hf engine server really runs with the share it was given."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.config.schema import StrategyArgs, WorkerConfig
from asyncrl.threads import (
    DriverThreads,
    ThreadBudgetError,
    ThreadShare,
    plan_threads,
    usable_cores,
)


def _threads(shares):
    return [s.threads for s in shares]


def _cpus(shares):
    return [s.cpus for s in shares]


def test_two_cores_give_the_learner_one_and_the_engine_one():
    budget = plan_threads([0, 1], ranks=1, engines=1)
    assert budget.learner == (ThreadShare(1, (0,)),)
    assert budget.engines == (ThreadShare(1, (1,)),)
    assert budget.note == ""
    assert "1 learner x 1 thread(s) on cpus [0]" in budget.describe()


def test_pins_to_the_usable_core_ids_not_to_a_count():
    budget = plan_threads([2, 5], ranks=1, engines=1)  # e.g. a container's cpu set
    assert _cpus(budget.learner) == [(2,)] and _cpus(budget.engines) == [(5,)]


@pytest.mark.parametrize(
    ("cores", "ranks", "engines", "learner", "engine"),
    [
        (16, 1, 1, [8], [8]),
        (16, 2, 1, [5, 5], [6]),  # ranks stay equal (FSDP waits for the slowest)
        (7, 2, 1, [2, 2], [3]),
        (16, 1, 2, [6], [5, 5]),
        (8, 3, 1, [2, 2, 2], [2]),
        (3, 2, 0, [1, 1], []),  # a leftover core no rank can share evenly stays free
    ],
)
def test_auto_splits_evenly_with_disjoint_pins(cores, ranks, engines, learner, engine):
    budget = plan_threads(list(range(cores)), ranks, engines)
    assert _threads(budget.learner) == learner and _threads(budget.engines) == engine
    pinned = [c for s in (*budget.learner, *budget.engines) for c in s.cpus]
    assert len(pinned) == len(set(pinned)) == sum(learner + engine) <= cores
    assert all(len(s.cpus) == s.threads for s in (*budget.learner, *budget.engines))


def test_explicit_counts_override_and_auto_takes_the_rest():
    budget = plan_threads(list(range(8)), 1, 1, learner=3)
    assert _threads(budget.learner) == [3] and _threads(budget.engines) == [5]
    budget = plan_threads(list(range(8)), 1, 2, learner=1, engine=2)
    assert _threads(budget.learner) == [1] and _threads(budget.engines) == [2, 2]
    assert _cpus(budget.engines) == [(1, 2), (3, 4)]


def test_more_processes_than_cores_are_not_pinned():
    budget = plan_threads([0, 1], ranks=1, engines=2)
    assert _threads(budget.learner) == [1] and _threads(budget.engines) == [1, 1]
    assert not any(s.cpus for s in (*budget.learner, *budget.engines))
    assert "oversubscribed" in budget.note and "oversubscribed" in budget.describe()


def test_pin_off_sets_threads_without_pinning():
    budget = plan_threads([0, 1], ranks=1, engines=1, pin=False)
    assert _threads(budget.learner) == [1] and _threads(budget.engines) == [1]
    assert not any(s.cpus for s in (*budget.learner, *budget.engines))
    assert budget.note == "pinning off"


def test_a_learner_on_an_accelerator_is_not_budgeted_under_auto():
    budget = plan_threads(list(range(4)), 1, 1, learner_on_cpu=False)
    assert budget.learner == (ThreadShare(),)  # torch's default: its CPU threads feed the GPU
    assert _threads(budget.engines) == [4]
    budget = plan_threads(list(range(4)), 1, 1, learner=2, learner_on_cpu=False)
    assert budget.learner == (ThreadShare(2),)  # as asked, never pinned off the CPU
    assert _threads(budget.engines) == [2]


def test_sglang_or_remote_engines_leave_the_cores_to_the_learner():
    assert plan_threads([0, 1], 1, 0).learner == (ThreadShare(2, (0, 1)),)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("learner", 0, "threads.learner must be auto or an integer >= 1, got 0"),
        ("engine", -2, "threads.engine must be auto or an integer >= 1, got -2"),
        ("learner", True, "threads.learner must be auto or an integer >= 1, got True"),
        ("engine", "many", "threads.engine must be auto or an integer >= 1, got 'many'"),
        ("learner", 3, "threads.learner 3 exceeds the 2 usable cores of this machine"),
    ],
)
def test_refusals_name_the_key(key, value, message):
    with pytest.raises(ThreadBudgetError) as e:
        plan_threads([0, 1], 1, 1, **{key: value})
    assert str(e.value) == message


def test_config_validation_refuses_in_one_line():
    too_many = len(usable_cores()) + 1
    for override, says in [
        ("threads.learner=0", "threads.learner must be auto or an integer >= 1"),
        (f"threads.engine={too_many}", f"threads.engine {too_many} exceeds the"),
        ("threads.pin=maybe", "threads.pin"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [override])
        assert says in str(e.value) and "\n" not in str(e.value)
    cfg = load_config(None, ["threads.learner=1", "threads.engine=1", "threads.pin=false"])
    assert (cfg.threads.learner, cfg.threads.engine, cfg.threads.pin) == (1, 1, False)
    assert load_config(None, []).threads.learner == "auto"


def test_share_as_server_arguments():
    assert ThreadShare().args() == []
    assert ThreadShare(2, (3, 4)).args() == ["--num-threads", "2", "--cpus", "3,4"]


def test_driver_share_is_restored_after_the_run():
    before_threads, before_cpus = torch.get_num_threads(), os.sched_getaffinity(0)
    core = usable_cores()[-1]
    with DriverThreads(ThreadShare(1, (core,))) as driver:
        assert torch.get_num_threads() == 1
        assert os.sched_getaffinity(0) == before_cpus  # not pinned before `pin()`
        driver.pin()
        assert os.sched_getaffinity(0) == {core}
    assert torch.get_num_threads() == before_threads
    assert os.sched_getaffinity(0) == before_cpus


def _server_info(url: str) -> dict:
    with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
        return json.loads(r.read())


def test_launched_engine_runs_with_its_share(tiny_model, tmp_path):
    """The fleet's launcher hands engine i its share; the server reports what it runs with."""
    from asyncrl.engine.hf.launch import HFLauncher

    infer = WorkerConfig(strategy_args=StrategyArgs("hf_infer"))
    launcher = HFLauncher(infer, tiny_model, tmp_path, seed=0)
    core = usable_cores()[-1]
    launcher.threads = [ThreadShare(1, (core,))]
    with launcher.launch(0) as handle:
        info = _server_info(handle.url)
    assert info["num_threads"] == 1 and info["cpus"] == [core]
    launcher.threads = [ThreadShare(2)]  # threads only: not pinned, every usable core
    with launcher.wait_ready(launcher.spawn(0)) as handle:
        info = _server_info(handle.url)
    assert info["num_threads"] == 2 and info["cpus"] == usable_cores()

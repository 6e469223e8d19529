"""verl's `actor.profiler` (tool: torch): a trace of the chosen learner steps, and nothing of
the others; refused settings are one line each."""

from __future__ import annotations

import json

import pytest

from asyncrl.config import load_config
from asyncrl.config.schema import ConfigError, ProfilerConfig
from asyncrl.learner.profiler import profile_step, trace_dir
from asyncrl.run import run
from tests.test_e2e import shrunk


def test_a_short_run_traces_only_the_chosen_step(tiny_model, tmp_path):
    cfg = shrunk(
        tiny_model, tmp_path, "max_steps=3", "logging.eval_interval=0",
        "actor.profiler.tool=torch", "actor.profiler.enable=true", "actor.profiler.steps=[2]",
    )  # fmt: skip
    run(cfg)
    traces = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert traces == ["step_2.json"]  # steps 1 and 3 ran untraced
    trace = json.loads((tmp_path / "profile" / "step_2.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert len(trace["traceEvents"]) > 10
    assert any(n.startswith("aten::") for n in names)  # the learner's torch ops are in it


def test_profile_step_writes_nothing_for_other_steps(tmp_path):
    cfg = ProfilerConfig(tool="torch", enable=True, steps=[2], save_path=str(tmp_path / "p"))
    for step in (1, 3):
        with profile_step(cfg, tmp_path, step):
            sum(range(10))
    assert not (tmp_path / "p").exists()
    with profile_step(cfg, tmp_path, 2):
        sum(range(10))
    assert json.loads((tmp_path / "p" / "step_2.json").read_text())["traceEvents"] is not None
    assert trace_dir(ProfilerConfig(), tmp_path) == tmp_path / "profile"


def test_disabled_profiler_traces_nothing(tmp_path):
    cfg = ProfilerConfig(tool="torch", enable=False, steps=[1])
    with profile_step(cfg, tmp_path, 1):
        pass
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["actor.profiler.tool=nsys"], "^actor.profiler.tool: nsys is not supported"),
        (["actor.profiler.tool=npu"], "^actor.profiler.tool: npu is not supported"),
        (["actor.profiler.enable=true", "actor.profiler.tool=torch"], "non-empty steps"),
        (["actor.profiler.enable=true", "actor.profiler.steps=[1]"], "needs tool: torch"),
        (
            ["actor.profiler.enable=true", "actor.profiler.tool=torch", "actor.profiler.steps=[0]"],
            r"steps\[\] must be in \[1, 60\]",
        ),
        (["actor.profiler.ranks=[0,1]"], r"ranks: \[1\]"),
        (["actor.profiler.tool_config.torch.step_start=2"], "whole learner steps"),
        (
            [
                "actor.profiler.enable=true",
                "actor.profiler.tool=torch",
                "actor.profiler.steps=[1]",
                "actor_train.device_mapping=[0,1]",
            ],
            "learners in Ray actors",
        ),
    ],
)
def test_profiler_settings_a_run_cannot_honour_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)

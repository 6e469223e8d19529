"""Evaluation off the critical path: the real loop (Ray, rollout actors, an hf engine server,
the torch learner) with held-out evaluation every step, `logging.eval_sync` auto (pinned) and
wait. Nothing is faked; each evaluation is held in flight (with a deadline) until the learner
has finished the next step, which only a loop that trains while an evaluation is in flight can
do."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

import asyncrl.run as run_module
from asyncrl.rollout.evaluation import Evaluator
from tests.test_e2e import shrunk

DEADLINE_S = 120.0


@pytest.mark.parametrize("eval_sync", ["auto", "wait"])
def test_learner_steps_while_an_evaluation_is_in_flight_and_results_land_on_their_step(
    tiny_model, tmp_path, monkeypatch, eval_sync
):
    steps_done: list[int] = []  # learner versions after each completed step
    stepped = threading.Condition()
    held: list[tuple[int, bool]] = []  # (pinned version, whether the next step came first)

    real_make_learner = run_module.make_learner

    def make_learner(*args, **kwargs):
        learner = real_make_learner(*args, **kwargs)
        real_step = learner.step

        def step(groups):
            out = real_step(groups)
            with stepped:
                steps_done.append(learner.version)
                stepped.notify_all()
            return out

        learner.step = step
        return learner

    real_generate = Evaluator._generate

    async def generate(self, clients, version, pin):
        def next_step_done() -> bool:
            with stepped:
                return stepped.wait_for(lambda: version + 1 in steps_done, DEADLINE_S)

        # Generated at once (pinned to `version` with `auto`: its requests must reach the engine
        # before that version is replaced), then held in flight until the next step is done.
        # The last step's evaluation has no next step: it completes at once (and must land).
        out = await real_generate(self, clients, version, pin)
        last = version == 3
        held.append((version, last or await asyncio.to_thread(next_step_done)))
        return out

    monkeypatch.setattr(run_module, "make_learner", make_learner)
    monkeypatch.setattr(Evaluator, "_generate", generate)
    cfg = shrunk(
        tiny_model,
        tmp_path,
        "max_steps=3",
        "logging.eval_interval=1",
        f"logging.eval_sync={eval_sync}",
    )
    summary = run_module.run(cfg)

    # every evaluation but the last was still in flight when the learner finished a later step
    assert held == [(0, True), (1, True), (2, True), (3, True)]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # one row per step, in order; each evaluation landed in the row of the step whose weights
    # it measured (the engines' version = that step's here), the last one before the summary
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["eval/version"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    assert [r.get("version") for r in rows] == [None, 1.0, 2.0, 3.0]
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in rows)
    assert summary["eval_count"] == 4 and summary["steps"] == 4

"""The token budget and the adaptive staleness bound in the real loop (Ray, an hf engine, ZMQ,
the replay queue, the torch learner), shrunk: each config value has its effect in the metrics.

`async.max_inflight_tokens` at one batch's worst case holds the tokens in flight and buffered
within it (and so fewer groups than the group budget of max_staleness would admit);
`async.max_staleness: auto` with a target no stale group can meet (ESS 1.0: any update moves
the IS weights off 1; the IS weights' ESS, `async.staleness_signal: weights`, because this
batch's 6 rows are fewer than the 8 the default sequence signal counts a lag from: that one
is driven through the real learner in test_capability_effects.py) tightens the bound from
its start, 1, to 0 once lag-1 groups have missed it twice, logs the change in one line, and every group trained after that is fresh.

    pytest -m slow tests/test_stale_controls_e2e.py"""

from __future__ import annotations

import dataclasses

import pytest

from asyncrl.checkpoint import load_msgpack
from asyncrl.replay import ControlSettings
from asyncrl.run import run
from tests.test_e2e import read_rows, shrunk

# rollout_batch_size 2 x n 3 x (prompt_length 8 + response_length 6): the smallest budget
BUDGET = 2 * 3 * (8 + 6)


@pytest.mark.slow  # ~25 s, its start-up mostly; the matrix runs both values in the default suite
def test_token_budget_and_auto_bound_in_the_real_loop(tiny_model, tmp_path, capsys):
    cfg = shrunk(
        tiny_model, tmp_path, "max_steps=6", "prompt_length=8", "async.max_staleness=auto",
        "async.target_ess=1.0", "async.staleness_signal=weights", "logging.eval_interval=0",
        f"async.max_inflight_tokens={BUDGET}",
    )  # fmt: skip
    run(cfg)
    rows = [r for r in read_rows(tmp_path) if r.get("version") is not None]
    assert len(rows) == 6 and rows[-1]["version"] == 6
    # the token budget: present, never exceeded, and tighter than max_staleness 1's groups
    assert all(r["replay/token_budget"] == BUDGET for r in rows)
    assert all(0 < r["replay/tokens_held_peak"] <= BUDGET for r in rows)
    assert all(r["replay/tokens_held"] <= BUDGET for r in rows)
    assert all(r["replay/tokens_buffered_peak"] <= BUDGET for r in rows)
    # each prompt holds at least 3 x (4 + 1) tokens once delivered, 3 x (4 + 6) before: at
    # most 3 fit in 84, where the group budget alone keeps (1 + 1) x 2 = 4 in flight
    assert all(r["replay/running"] + r["replay/depth"] <= 3 for r in rows)
    # the adaptive bound: lag-1 groups measured, below target, the bound tightened to 0
    bounds = [r["replay/staleness_bound"] for r in rows]
    assert bounds[0] == 1 and 0 in bounds, bounds
    changed = next(i for i, r in enumerate(rows) if r["replay/staleness_change"] != 0)
    assert rows[changed]["replay/staleness_change"] == -1
    assert any("is/ess_by_lag/1" in r for r in rows[: changed + 1])
    assert rows[changed]["replay/staleness_signal"] < 1.0
    after = rows[changed + 1 :]
    assert all(r["replay/staleness_max"] == 0 for r in after), [
        r["replay/staleness_max"] for r in after
    ]
    out = capsys.readouterr().out
    line = (
        f"asyncrl: step {rows[changed]['step']}: staleness bound tightened 1 -> 0: IS weights' ESS"
    )
    assert line in out and "target 1 for 2 step(s)" in out
    check_resume(cfg, tmp_path)


def check_resume(cfg, out) -> None:
    """Resumed from step 6: the controller goes on where it stopped (bound 0, its healthy
    streak; a fresh one would start at 1), and the token count restarts consistent."""
    saved = load_msgpack(out / "checkpoints" / "step_6" / "extra.msgpack")
    control = saved["queue"]["staleness_control"]
    assert control["bound"] == 0 and control["healthy"] >= 2
    relax_at = 6 + ControlSettings(4).relax_after - control["healthy"]  # nothing stale at 0
    run(dataclasses.replace(cfg, max_steps=8, actor=_resuming(cfg.actor)))
    rows = {r["step"]: r for r in read_rows(out) if r.get("version") is not None}
    assert [rows[s]["replay/staleness_bound"] for s in range(7, relax_at)] == [0] * (relax_at - 7)
    assert rows[relax_at]["replay/staleness_change"] == 1
    for s in (7, 8):
        assert rows[s]["replay/tokens_held"] <= BUDGET
        assert rows[s]["replay/tokens_held_peak"] >= rows[6]["replay/tokens_held_peak"]


def _resuming(actor):
    checkpoint = dataclasses.replace(actor.checkpoint, resume="auto")
    return dataclasses.replace(actor, checkpoint=checkpoint)

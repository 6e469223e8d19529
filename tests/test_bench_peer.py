"""`asyncrl bench peer` (asyncrl vs TRL's GRPOTrainer): its timing and ratio helpers, the TRL
settings it derives from asyncrl's config, the prompts it hands TRL, and (where the `peer`
extra is installed) a smoke run through the CLI. Speed targets are judged by the full bench,
never here."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import peer  # noqa: E402


def test_step_ends_take_the_logger_start_from_the_least_delayed_row():
    start = 1000.0
    rows = [  # step 1's row waited 3 s for its evaluation; step 0 is the start evaluation
        {"step": 0, "time": 0.1, "timestamp": start + 0.1},
        {"step": 1, "time": 2.0, "timestamp": start + 5.0},
        {"step": 2, "time": 3.0, "timestamp": start + 5.0},
        {"step": 3, "time": 4.0, "timestamp": start + 4.0},
    ]
    assert peer.asyncrl_step_ends(rows) == pytest.approx([1002.0, 1003.0, 1004.0])
    with pytest.raises(ValueError, match="no row"):
        peer.asyncrl_step_ends([])


def test_rl_phase_counts_steps_two_to_n_and_the_time_to_the_first_step():
    got = peer.rl_phase([10.0, 12.0, 14.0], completions_per_step=64, started=5.0)
    assert got == {"steps": 3, "completions_per_s": 32.0, "rl_wall_s": 4.0, "first_step_s": 5.0}
    with pytest.raises(ValueError, match="at least 2 steps"):
        peer.rl_phase([10.0], 64, 0.0)
    with pytest.raises(ValueError, match="do not increase"):
        peer.rl_phase([10.0, 10.0], 64, 0.0)


def _run(cps: float, gain: float) -> dict:
    return {"completions_per_s": cps, "heldout_gain": gain, "rl_wall_s": 1.0}


def test_ratios_use_the_faster_trl_setting_and_require_an_equal_gain():
    runs = {"asyncrl_async": _run(300.0, 0.40), "asyncrl_sync": _run(210.0, 0.30),
            "trl_1t": _run(200.0, 0.42), "trl_2t": _run(150.0, 0.50)}  # fmt: skip
    got = peer.ratios(runs, margin=0.05)
    assert got["trl_best"] == "trl_1t"  # the faster one, whatever its gain
    assert got["async"] == {"ratio": 1.5, "target": 1.5, "gain_ok": True, "passed": True}
    assert got["sync"]["ratio"] == pytest.approx(1.05)
    assert got["sync"]["gain_ok"] is False and got["sync"]["passed"] is False  # 0.30 < 0.42-0.05
    runs["trl_2t"] = _run(400.0, 0.40)
    got = peer.ratios(runs, margin=0.05)
    assert got["trl_best"] == "trl_2t" and got["async"]["ratio"] == 0.75
    assert got["async"]["passed"] is False


def test_median_runs_is_per_system_and_per_figure():
    rounds = [{s: _run(100.0 * (i + 1), 0.1 * i) for s in peer.SYSTEMS} for i in range(3)]
    med = peer.median_runs(rounds)
    assert set(med) == set(peer.SYSTEMS)
    assert med["trl_1t"] == {"completions_per_s": 200.0, "heldout_gain": 0.1, "rl_wall_s": 1.0}


def test_trl_settings_match_the_default_budget_loss_and_optimizer():
    cfg = peer.load_cfg(60)
    s = peer.trl_settings(cfg)
    generation_batch = s["per_device_train_batch_size"] * s["steps_per_generation"]
    assert generation_batch == 8 * 8 == s["num_generations"] * cfg.rollout_batch_size
    assert s["gradient_accumulation_steps"] == s["steps_per_generation"]  # one update a batch
    assert (s["loss_type"], s["beta"], s["num_iterations"]) == ("dapo", 0.0, 1)
    assert (s["learning_rate"], s["weight_decay"], s["max_grad_norm"]) == (5e-5, 0.0, 1.0)
    assert (s["adam_beta1"], s["adam_beta2"], s["adam_epsilon"]) == (0.9, 0.999, 1e-8)
    assert (s["max_completion_length"], s["temperature"], s["max_steps"]) == (32, 1.0, 60)
    assert s["shuffle_dataset"] is False and s["bf16"] is False and s["epsilon"] == 0.2
    with pytest.raises(ValueError, match="token-mean"):
        peer.trl_settings(peer.load_cfg(60, ["actor.loss_agg_mode=seq-mean-token-mean"]))


def test_train_rows_are_prompt_source_order_with_metadata(tiny_model):
    from asyncrl.data.prompts import PromptSource

    cfg = peer.load_cfg(2)
    rows = peer.train_rows(cfg, tiny_model)
    source = PromptSource(cfg, tiny_model)
    expected = [source.next_item() for _ in range(2 * cfg.rollout_batch_size)]
    assert [r["prompt"] for r in rows] == [it.prompt_text for it in expected]
    assert [r["answer"] for r in rows] == [it.metadata["answer"] for it in expected]
    held = peer.heldout_rows(cfg, 5)
    assert len(held) == 5 and all(r["prompt"].endswith("=") and "answer" in r for r in held)
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in rows}


def test_bench_peer_smoke(tmp_path):
    pytest.importorskip("trl", reason="the `peer` extra (TRL) is not installed")
    from asyncrl.cli import main

    assert main(["bench", "peer", "--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "peer.json").read_text())
    assert result["smoke"] is True and len(result["rounds"]) == result["rounds_n"] == 1
    for system in peer.SYSTEMS:
        run = result["rounds"][0][system]
        assert run["steps"] == result["steps"] and run["completions_per_s"] > 0
        assert 0.0 <= run["heldout_accuracy"] <= 1.0 and run["first_step_s"] > 0
    assert result["ratios"]["trl_best"] in ("trl_1t", "trl_2t")
    assert all(math.isfinite(h["value"]) for h in result["headline"].values())
    assert (tmp_path / "peer.png").stat().st_size > 0


def test_trl_order_check_names_the_first_completion_out_of_order():
    rows = [{"prompt": p} for p in ("1+1=", "2+2=", "3+3=")]
    peer.check_trl_order(["1+1=", "1+1=", "2+2=", "2+2="], rows, n=2)  # two steps of one prompt
    with pytest.raises(RuntimeError, match="at completion 2"):
        peer.check_trl_order(["1+1=", "1+1=", "3+3=", "3+3="], rows, n=2)
    with pytest.raises(RuntimeError, match="differs"):
        peer.check_trl_order([], rows, n=2)

"""`asyncrl bench premise`'s arithmetic: the standard errors and paired differences its table
judges a gap by, and the reuse of recorded runs. Its real runs: test_bench_smoke.py (slow)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import premise  # noqa: E402


def run(variant: str, seed: int, acc: float, tps: float = 1000.0, **extra) -> dict:
    return {"variant": variant, "seed": seed, "lr": 1e-4, "eval_last3": acc,
            "staleness_mean": 1.0, "mismatch_kl_mean": 0.0, "tokens_per_s": tps, **extra}  # fmt: skip


def test_standard_error_and_the_differences_by_seed():
    assert premise.std_error([0.5]) is None
    assert premise.std_error([0.5, 0.7]) == pytest.approx(math.sqrt(0.02) / math.sqrt(2))
    # auto is 2 points under bound 2 on every seed, though the seeds spread by 10 points
    bound2 = [run("bound2_geometric", s, a) for s, a in enumerate((0.50, 0.60, 0.55))]
    auto = [run("auto", s, a - 0.02, tps=960.0) for s, a in enumerate((0.50, 0.60, 0.55))]
    rows = {r["variant"]: r for r in premise.summarise(bound2 + auto)}
    assert rows["auto"]["se"] == pytest.approx(rows["bound2_geometric"]["se"])
    gap = premise.difference(rows["auto"], rows["bound2_geometric"])
    assert gap["points"] == pytest.approx(-2.0) and gap["paired_points"] == pytest.approx(-2.0)
    assert gap["paired_seeds"] == 3 and gap["paired_points_se"] == pytest.approx(0.0, abs=1e-9)
    assert gap["points_se"] == pytest.approx(100 * math.sqrt(2) * rows["auto"]["se"])
    verdict = premise.verdicts(list(rows.values()))["auto_vs_best_fixed"]
    assert verdict["best"] == "bound2_geometric" and verdict["tokens_per_s_ratio"] == 0.96
    assert verdict["accuracy_points"] == pytest.approx(-2.0) and not verdict["met"]


def test_only_seeds_both_ran_are_paired():
    a = premise.summarise([run("auto", s, 0.5) for s in (0, 1, 2)])[0]
    b = premise.summarise([run("sync", s, 0.6) for s in (1, 2, 3)])[0]
    gap = premise.difference(a, b)
    assert gap["paired_seeds"] == 2 and gap["paired_points"] == pytest.approx(-10.0)


def test_reuse_takes_the_other_variants_and_renames_the_old_auto(tmp_path):
    recorded = {"lr": 1e-4, "steps": 60, "runs": [
        run("sync", 0, 0.5), run("sync", 7, 0.5), run("auto", 0, 0.4), run("auto_kl", 0, 0.45),
        run("auto", 1, 0.4, seq_ess_by_lag={"4": 0.8}),
    ]}  # fmt: skip
    path = tmp_path / "premise_auto.json"
    path.write_text(json.dumps(recorded))
    got = premise.reused(path, ["auto"], [0, 1], 1e-4, 60)
    # sync seed 7 is not asked for; auto recorded before the sequence ESS existed steered by
    # the weights' ESS (today's auto_weights); today's auto is being run, so not reused
    assert [(r["variant"], r["seed"]) for r in got] == [
        ("sync", 0),
        ("auto_weights", 0),
        ("auto_kl", 0),
    ]
    with pytest.raises(SystemExit, match="lr 0.0001, 60 steps; this run: lr 0.0002"):
        premise.reused(path, ["auto"], [0], 2e-4, 60)

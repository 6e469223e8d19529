"""Stale-group policies, evict vs wait vs correct: throughput, learner idle and length bias.

Two parts, the same three policies (`async.stale_policy`):

1. A long-tailed workload on the real orchestration (the `ReplayQueue` with its admission and
   ledger, the `Dispatcher`, the codec, ZMQ and the pump, as `bench simulate` drives them) with
   simulated engines and learner: responses log-normal (median 512 tokens, sigma 1.0, at most
   8k), so the slowest groups of a batch take several learner steps and come back past
   max_staleness 1. Reported: trained tokens/s, learner idle %, trained ÷ generated mean
   response length (1.0 = no bias), groups evicted, groups trained past the bound.
2. The CPU default (`asyncrl run` on the embedded model) for a fixed number of steps under each
   policy: held-out accuracy at the end, tokens/s, learner idle, the length ratio, and the IS
   weights' normalised ESS by staleness (`is/ess_by_lag/<k>`, mean over the steps that trained
   lag-k sequences; the simulated part has no weights to report).

3. Fixed bounds (0, 1, 2, 4), token budgets (`async.max_inflight_tokens`, 1x, 2x and 4x one batch
   at its worst case, beside a group bound of 4) and the adaptive bound (`max_staleness: auto`,
   under a slow- and a fast-moving policy's modelled IS ESS) on the simulated workload of part
   1 (`_staleness_bounds.py`): tokens/s against the best fixed bound, peak buffered and held
   tokens against the budget, the bound auto settles at, steps below the ESS target.

Targets: correct keeps >= 0.95x the trained tokens/s of evict with a length ratio >= 0.95; a
token budget and auto keep >= 0.95x the best fixed bound's (auto under the fast policy: the
best fixed bound that keeps the ESS target), the budget never exceeded.

    asyncrl bench staleness [--smoke] [--policies evict,wait,correct] [--skip-real]
                            [--skip-bounds]
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from _staleness_bounds import HEADERS, run_bounds, table_rows
from common import finish, headline, make_parser, print_table
from simulate import Calibration, Workload, run_cluster

from asyncrl.replay.queue import ReplayConfig, ReplayQueue

POLICIES = ("evict", "wait", "correct")
TARGET_THROUGHPUT, TARGET_RATIO = 0.95, 0.95
HARD = 4  # async.max_staleness_hard of correct
#: correct needs sequence-level (or geometric) rollout IS with a veto (`config validate`).
CORRECT_IS = ["algorithm.rollout_is_level=geometric", f"async.max_staleness_hard={HARD}"]
LONG_TAIL = Calibration(median_len=512, sigma=1.0, max_len=8192)


def simulate_policy(policy: str, cal: Calibration, work: Workload, actors: int) -> dict:
    """One policy on the simulated long-tailed cluster (real queue, dispatcher, transport)."""
    cfg = ReplayConfig(work.max_staleness, work.batch, stale_policy=policy, max_staleness_hard=HARD)
    replay = ReplayQueue(cfg)
    steps = run_cluster(replay, actors, cal, work)
    return _summary(policy, steps, replay.metrics(), work)


def _summary(policy: str, steps: list[dict], qm: dict, work: Workload) -> dict[str, Any]:
    warm = max(1, min(work.warmup, len(steps) // 3))
    window = steps[warm:]
    if not window:
        raise RuntimeError(f"{policy}: only {len(steps)} steps in {work.max_wall_s}s")
    wall = window[-1]["end"] - steps[warm - 1]["end"]
    idle = sum(s["got"] - s["start"] for s in window)
    return {
        "policy": policy,
        "steps_measured": len(window),
        "tokens_per_s_sim": sum(s["tokens"] for s in window) / wall / work.speedup,
        "learner_idle_pct": 100 * idle / wall,
        "length_ratio": qm.get("length_ratio", float("nan")),
        "generated_length_mean": qm["generated_length_mean"],
        "trained_length_mean": qm["trained_length_mean"],
        "evicted": qm["evicted"],
        "over_bound": qm["over_bound"],
        "staleness_mean": qm["lag_taken_mean"],
    }


def real_policy(policy: str, steps: int, eval_size: int, out: Path) -> dict[str, Any]:
    """The CPU default (embedded model) for `steps` steps under `policy`."""
    from asyncrl.config import load_config
    from asyncrl.run import run

    extra = CORRECT_IS if policy == "correct" else []
    cfg = load_config(None, [
        f"output_dir={out}", f"max_steps={steps}", f"async.stale_policy={policy}",
        f"logging.eval_interval={steps}", f"logging.eval_size={eval_size}",
        "logging.console=false", "logging.tensorboard=false", "logging.plots=false",
        "actor.checkpoint.save_contents=[]", *extra,
    ])  # fmt: skip
    summary = run(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    window = [r for r in rows if "record" not in r and r["step"] > 1]  # after the first batch
    wall = window[-1]["time"] - rows[0]["time"] if window else float("nan")
    waits = sum(r["learner/wait_seconds"] for r in window)
    return {
        "policy": policy,
        "steps": steps,
        "eval_accuracy": summary["eval_last"],
        "eval_gain_points": summary["eval_gain_points"],
        "tokens_per_s": statistics.fmean(r["throughput/tokens_per_s"] for r in window),
        "learner_idle_pct": 100 * waits / wall,
        "length_ratio": summary["length_ratio"],
        "evicted": summary["groups_evicted"],
        "over_bound": summary["groups_over_bound"],
        "ess_by_lag": ess_by_lag(window),
    }


def ess_by_lag(rows: list[dict]) -> dict[str, float]:
    """{lag: mean normalised ESS} of the IS weights over the metric rows that hold that lag
    (`is/ess_by_lag/<k>`); empty when the run computed no IS weights."""
    prefix, per_lag = "is/ess_by_lag/", {}
    for row in rows:
        for key, value in row.items():
            if key.startswith(prefix) and value is not None:
                per_lag.setdefault(int(key[len(prefix) :]), []).append(value)
    return {str(k): statistics.fmean(v) for k, v in sorted(per_lag.items())}


def _show_ess(ess: dict[str, float]) -> str:
    return " ".join(f"{k}:{v:.3f}" for k, v in ess.items()) or "-"


def _plot(sim: list[dict]):
    def draw(fig: Any) -> None:
        axes = fig.subplots(1, 3)
        names = [r["policy"] for r in sim]
        for ax, key, label in zip(
            axes,
            ("tokens_per_s_sim", "learner_idle_pct", "length_ratio"),
            ("trained tokens/s (simulated)", "learner idle %", "trained ÷ generated length"),
            strict=True,
        ):
            ax.bar(names, [r[key] for r in sim])
            ax.set_title(label, fontsize=9)
        axes[2].axhline(TARGET_RATIO, ls="--", c="k")

    return draw


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--actors", type=int, default=32)
    parser.add_argument("--real-steps", type=int, default=None, help="CPU default: steps")
    parser.add_argument("--skip-real", action="store_true", help="the simulated parts only")
    parser.add_argument("--skip-bounds", action="store_true", help="no part 3 (bounds, auto)")
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    smoke = args.smoke
    work = Workload(batch=32, n=8, max_staleness=1, inflight=4, steps=30, warmup=5,
                    speedup=100.0, max_wall_s=40.0)  # fmt: skip
    if smoke:
        work = replace(work, batch=8, steps=8, warmup=2, max_wall_s=8.0)
    sim = [simulate_policy(p, LONG_TAIL, work, 8 if smoke else args.actors) for p in policies]
    if sim:
        _table_sim(sim)
    bounds: list[dict] = []
    if not args.skip_bounds:  # longer: the adaptive bound moves one step per 4 learner steps
        longer = replace(work, steps=40, warmup=8, max_wall_s=60.0)
        longer = replace(work, steps=6, max_wall_s=5.0) if smoke else longer
        bounds, vs_fixed = run_bounds(LONG_TAIL, longer, 8 if smoke else args.actors, smoke)
        print_table("fixed bounds, token budgets, auto (simulated long tail; ESS modelled: "
                    "fixed rows under the fast policy)", HEADERS, table_rows(bounds))  # fmt: skip
        for row, c in vs_fixed.items():
            if isinstance(c, dict):
                verdict = "met" if c["met"] else "MISSED"
                print(f"{row}: {c['ratio']:.3f}x the tokens/s of {c['reference']} ({verdict})")
    real: list[dict] = []
    if not args.skip_real:
        steps = args.real_steps or (2 if smoke else 20)
        with tempfile.TemporaryDirectory() as tmp:
            for p in policies:
                real.append(real_policy(p, steps, 16 if smoke else 100, Path(tmp) / p))
        _table_real(real)
    by = {r["policy"]: r for r in sim}
    ratios, met = {}, {}
    if "evict" in by and "correct" in by:
        ratios["correct_throughput_vs_evict"] = (
            by["correct"]["tokens_per_s_sim"] / by["evict"]["tokens_per_s_sim"]
        )
        met["throughput"] = ratios["correct_throughput_vs_evict"] >= TARGET_THROUGHPUT
        met["length_ratio"] = by["correct"]["length_ratio"] >= TARGET_RATIO
        print(
            f"\ncorrect vs evict: {ratios['correct_throughput_vs_evict']:.3f}x tokens/s "
            f"(target >= {TARGET_THROUGHPUT}), length ratio {by['correct']['length_ratio']:.3f} "
            f"vs {by['evict']['length_ratio']:.3f} (target >= {TARGET_RATIO})"
        )
    heads = {f"{r['policy']}_length_ratio": headline(r["length_ratio"], True, "")
             for r in sim if r["length_ratio"] == r["length_ratio"]}  # fmt: skip
    # Part 3's ratios are one run against one run on a timed simulation (CPU contention moves
    # them by tens of %): recorded under `bounds` and `met`, not as headline figures.
    met.update({r["row"]: r["met"] for r in bounds if "met" in r})
    result = {
        "calibration": asdict(LONG_TAIL), "workload": asdict(work), "simulated": sim,
        "bounds": bounds, "real": real, "ratios": ratios, "met": met, "headline": heads,
    }  # fmt: skip
    return finish("staleness", result, args, _plot(sim), argv)


def _table_sim(rows: list[dict]) -> None:
    print_table(
        "long-tailed responses, max_staleness 1 (real queue + dispatcher + ZMQ, simulated engines)",
        ["policy", "tok/s (sim)", "idle %", "trained/generated len", "evicted", "over bound",
         "staleness"],
        [[r["policy"], r["tokens_per_s_sim"], r["learner_idle_pct"], r["length_ratio"],
          r["evicted"], r["over_bound"], r["staleness_mean"]] for r in rows],
    )  # fmt: skip


def _table_real(rows: list[dict]) -> None:
    print_table(
        "CPU default (embedded model), held-out accuracy after the fixed steps",
        ["policy", "steps", "eval acc", "gain pts", "tok/s", "idle %", "length ratio", "evicted",
         "over bound", "IS ESS by lag"],
        [[r["policy"], r["steps"], r["eval_accuracy"], r["eval_gain_points"], r["tokens_per_s"],
          r["learner_idle_pct"], r["length_ratio"], r["evicted"], r["over_bound"],
          _show_ess(r["ess_by_lag"])] for r in rows],
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())

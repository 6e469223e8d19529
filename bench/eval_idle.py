"""Held-out evaluation off the critical path: the default run's learner idle at evaluation steps.

The CPU default (`configs/default.yaml`: held-out evaluation of `logging.eval_size` prompts
every `logging.eval_interval` steps) run twice per round, in alternating order, differing only
in `logging.eval_sync`:
  wait   the sync after an evaluation step waits for the evaluation to finish;
  auto   the default: on hf engines the evaluation is pinned to its step's weights and runs in
         the engine's idle time while the syncs go ahead (evaluation yields to rollout:
         `engine/hf/schedule.py`).
From each run's metrics.jsonl (steps >= 2): the learner's idle % (`learner/idle_frac`) averaged
by the step's phase, `step % eval_interval` (phase 1 is the step after an evaluation was
submitted), the run's wall time over those steps, and how long an evaluation took
(`eval/seconds`). Target (issue 16): with `auto`, no phase's idle more than 5 points above the
median phase's (the learner-idle figure does not rise at evaluation steps). Also each run's
mean and worst single-step idle (a step can idle when the engine is over capacity, whatever its
phase). Medians over the rounds; every run's rows are kept in the result.

`--config` runs another recipe the same way, e.g. an env run's held-out episodes
(`configs/agentic_guess_number.yaml`: pinned where the engines lease a version between an
episode's turns); its result is `eval_idle_<config name>`.

    asyncrl bench eval-idle [--smoke] [--rounds 2] [--steps 60] [--config PATH]
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from common import finish, headline, make_parser, print_table

MODES = ("wait", "auto")
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
TARGET_RISE_PCT = 5.0
SMOKE = ["logging.eval_interval=2", "logging.eval_size=16", "rollout_batch_size=2"]


def run_once(
    config: Path, out: Path, mode: str, steps: int, extra: list[str]
) -> tuple[list[dict], int]:
    """One run of `config` with `logging.eval_sync: mode`: its metrics rows and evaluation
    interval. An evaluation that failed or ran off its version fails the bench (an idle-free
    run that dropped its evaluations would prove nothing)."""
    from asyncrl.config import load_config
    from asyncrl.run import run

    cfg = load_config(config, [
        f"output_dir={out}", f"max_steps={steps}", f"logging.eval_sync={mode}",
        "logging.console=false", "logging.plots=false", "logging.tensorboard=false",
        "actor.checkpoint.save_contents=[]", *extra,
    ])  # fmt: skip
    run(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    dropped = {k: v for k in ("rollout/eval_failures", "rollout/eval_off_version")
               if (v := rows[-1].get(k))}  # fmt: skip
    if dropped:
        raise RuntimeError(f"eval_sync {mode}: evaluations dropped: {dropped}")
    return rows, cfg.logging.eval_interval


def analyse(rows: list[dict[str, Any]], interval: int) -> dict[str, Any]:
    """Idle % by phase (`step % interval`), the wall time of steps 2.., evaluation seconds."""
    steps = [r for r in rows if r["step"] >= 2 and "learner/idle_frac" in r]
    by_step = [(r["step"], 100 * r["learner/idle_frac"]) for r in steps]
    phases: dict[int, list[float]] = {}
    for step, pct in by_step:
        phases.setdefault(step % interval, []).append(pct)
    idle = {p: statistics.mean(v) for p, v in sorted(phases.items())}
    evals = [r["eval/seconds"] for r in rows if "eval/seconds" in r]
    return {
        "idle_pct_by_phase": idle,
        "rise_pct": max(idle.values()) - statistics.median(idle.values()),
        "idle_pct_mean": statistics.mean(pct for _, pct in by_step),
        "idle_pct_max": max(pct for _, pct in by_step),
        "wall_s": steps[-1]["time"] - steps[0]["time"],
        "eval_s": statistics.median(evals) if evals else 0.0,
        "evals": len(evals),
        "idle_pct_by_step": by_step,
    }


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _plot(results: dict[str, list[dict[str, Any]]], name: str, fig: Any) -> None:
    ax = fig.subplots()
    for mode, runs in results.items():
        steps, idle = zip(*runs[0]["idle_pct_by_step"], strict=True)
        ax.plot(steps, idle, marker=".", label=f"eval_sync: {mode} (round 0)")
    ax.set_xlabel("step")
    ax.set_ylabel("learner idle %")
    ax.set_title(f"{name}: learner idle per step (evaluation every interval)")
    ax.legend()


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=2, help="wait+auto pairs (median)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="recipe to run")
    args = parser.parse_args(argv)
    rounds, steps = (1, 6) if args.smoke else (args.rounds, args.steps)
    extra = SMOKE if args.smoke else []
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for mode in MODES if i % 2 == 0 else reversed(MODES):  # alternating order
                out = Path(tmp) / f"{mode}{i}"
                rows, interval = run_once(args.config, out, mode, steps, extra)
                results[mode].append(analyse(rows, interval))
    phases = sorted(results["auto"][0]["idle_pct_by_phase"])
    headers = ["eval_sync", *(f"idle% {p}" for p in phases), "rise pts", "idle% mean", "max"]
    headers += ["wall s", "eval s"]
    table = [
        [mode, *(statistics.median(r["idle_pct_by_phase"][p] for r in runs) for p in phases),
         *(_median(runs, k) for k in ("rise_pct", "idle_pct_mean", "idle_pct_max", "wall_s",
                                      "eval_s"))]
        for mode, runs in results.items()
    ]  # fmt: skip
    print_table(f"learner idle % by step % {interval} (medians over {rounds} round(s))", headers,
                table)  # fmt: skip
    rise = _median(results["auto"], "rise_pct")
    print(f"auto: idle rises {rise:.1f} points at its worst phase (target <= {TARGET_RISE_PCT})")
    result = {
        "target_rise_pct": TARGET_RISE_PCT,
        "met": {"auto_rise": rise <= TARGET_RISE_PCT},
        "headline": {
            "auto_rise_pct": headline(rise, False, "pts"),
            "wait_rise_pct": headline(_median(results["wait"], "rise_pct"), False, "pts"),
            "auto_wall_s": headline(_median(results["auto"], "wall_s"), False, "s"),
        },
        "table": {"headers": headers, "rows": table},
        "runs": results,
    }
    stem = args.config.stem
    name = "eval_idle" if args.config.resolve() == DEFAULT_CONFIG else f"eval_idle_{stem}"
    return finish(name, result, args, lambda fig: _plot(results, stem, fig), argv, "eval-idle")


if __name__ == "__main__":
    raise SystemExit(main())

"""`asyncrl bench staleness`, part 3: fixed staleness bounds, token budgets and the adaptive bound
(`async.max_staleness: auto`) side by side on the simulated long-tailed workload.

The orchestration is real (`ReplayQueue` with its admission, token budget and controller, the
`Dispatcher`, codec, ZMQ and pump: `simulate.run_cluster`); engines and learner are simulated.
The simulated learner has no IS weights, so it reports a model of them: the normalised ESS of
a lag-k group is rho^k, rho standing for how fast the policy moves (slow 0.97: lag 4 keeps
0.885; fast 0.80: lag 2 already falls to 0.64), with the learner's metric names, and the
adaptive bound's controller reads them exactly as it reads a real learner's.

Reported per row: trained tokens/s (simulated time) and its ratio to the best fixed bound's
(for auto under the fast policy: to the best fixed bound that keeps the ESS target), learner
idle, the peak buffered tokens (delivered, not yet trained) and the peak held tokens (buffered
+ in flight, the token budget's quantity) against the budget, the mean staleness trained, the
bound at the end, and the steps whose trained groups' ESS fell below `async.target_ess`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from simulate import Calibration, Workload, run_cluster

from asyncrl.replay.buffer import staleness
from asyncrl.replay.queue import ReplayConfig, ReplayQueue
from asyncrl.replay.staleness_control import ESS_PREFIX, UNITS_PREFIX, ControlSettings
from asyncrl.replay.tokens import TokenBudget

BOUNDS = (0, 1, 2, 4)
HARD = 4  # auto's ceiling and the token-budget rows' group bound
TOKEN_BATCHES = (1, 2, 4)  # token budgets, in batches at their worst case
SPEEDS = {"slow": 0.97, "fast": 0.80}
TARGET_ESS = ControlSettings(HARD).target_ess
TARGET_RATIO = 0.95


class ModelESS:
    """The simulated learner's IS ESS by lag (rho^lag), fed to the queue's controller; records
    each step's bound and whether a trained stale lag (>= 1) fell below the target."""

    def __init__(self, replay: ReplayQueue, rho: float, n: int) -> None:
        self.replay, self.rho, self.n = replay, rho, n
        self.bounds: list[int] = []
        self.below: list[bool] = []

    def __call__(self, groups: list[Any], version: int) -> None:
        lags = Counter(staleness(g, version) for g in groups)
        metrics = {}
        for lag, count in lags.items():
            metrics[f"{ESS_PREFIX}{lag}"] = self.rho**lag
            metrics[f"{UNITS_PREFIX}{lag}"] = float(count * self.n)
        self.below.append(any(lag >= 1 and self.rho**lag < TARGET_ESS for lag in lags))
        self.replay.observe(metrics)  # None with a fixed bound
        self.bounds.append(self.replay.bound)


def worst_batch(cal: Calibration, work: Workload) -> int:
    """One batch at its worst case: the smallest token budget `config validate` accepts."""
    return work.batch * work.n * (cal.prompt_len + cal.max_len)


def one_row(label: str, cfg: ReplayConfig, rho: float, cal, work, actors: int) -> dict:
    replay = ReplayQueue(cfg)
    model = ModelESS(replay, rho, work.n)
    steps = run_cluster(replay, actors, cal, work, observe=model, prompt_ids=[0] * cal.prompt_len)
    warm = max(1, min(work.warmup, len(steps) // 3))
    window = steps[warm:]
    if not window:
        raise RuntimeError(f"{label}: only {len(steps)} steps in {work.max_wall_s}s")
    wall = window[-1]["end"] - steps[warm - 1]["end"]
    qm = replay.metrics()
    return {
        "row": label,
        "steps_measured": len(window),
        "tokens_per_s_sim": sum(s["tokens"] for s in window) / wall / work.speedup,
        "learner_idle_pct": 100 * sum(s["got"] - s["start"] for s in window) / wall,
        "peak_buffered_tokens": qm["tokens_buffered_peak"],
        "peak_held_tokens": qm.get("tokens_held_peak"),
        "token_budget": qm.get("token_budget"),
        "staleness_mean": qm["lag_taken_mean"],
        "evicted": qm["evicted"],
        "bound_last": model.bounds[-1] if model.bounds else None,
        "bound_mean": sum(model.bounds[warm:]) / max(1, len(model.bounds[warm:])),
        "steps_below_target": sum(model.below),
        "steps": len(steps),
    }


def rows_to_run(
    cal: Calibration, work: Workload, smoke: bool
) -> list[tuple[str, ReplayConfig, float]]:
    """(label, queue config, rho) per row: fixed bounds (their ESS counted under the fast
    policy), token budgets beside the group bound HARD, auto under each policy speed."""
    bounds, batches = ((1,), (2,)) if smoke else (BOUNDS, TOKEN_BATCHES)
    speeds = {"fast": SPEEDS["fast"]} if smoke else SPEEDS
    fast, prompt = SPEEDS["fast"], cal.prompt_len
    out = [(f"bound {b}", ReplayConfig(b, work.batch), fast) for b in bounds]
    for k in batches:
        tokens = TokenBudget(k * worst_batch(cal, work), work.n, prompt, cal.max_len)
        cfg = ReplayConfig(HARD, work.batch, tokens=tokens)
        out.append((f"tokens {k}x batch", cfg, fast))
    control = ControlSettings(HARD)
    for speed, rho in speeds.items():
        start = min(control.start, HARD)
        cfg = ReplayConfig(start, work.batch, max_staleness_hard=HARD, control=control)
        out.append((f"auto ({speed} policy)", cfg, rho))
    return out


def compare(rows: list[dict]) -> dict[str, Any]:
    """Ratios to the best fixed bound (overall; for auto under the fast policy, the best one
    that keeps the ESS target there) and whether each target was met."""
    fixed = {int(r["row"].split()[1]): r for r in rows if r["row"].startswith("bound")}
    if not fixed:
        return {}
    best = max(fixed.values(), key=lambda r: r["tokens_per_s_sim"])
    keeps = [r for b, r in fixed.items() if SPEEDS["fast"] ** b >= TARGET_ESS]
    best_fast = max(keeps or [best], key=lambda r: r["tokens_per_s_sim"])
    out: dict[str, Any] = {"best_fixed": best["row"], "best_fixed_fast": best_fast["row"]}
    for r in rows:
        if r["row"].startswith("bound"):
            continue
        ref = best_fast if "fast" in r["row"] else best
        ratio = r["tokens_per_s_sim"] / ref["tokens_per_s_sim"]
        met = ratio >= TARGET_RATIO
        if r["token_budget"]:
            met = met and r["peak_held_tokens"] <= r["token_budget"]
        r["vs_best_fixed"], r["reference"], r["met"] = ratio, ref["row"], met
        out[r["row"]] = {"ratio": ratio, "reference": ref["row"], "met": met}
    return out


def run_bounds(cal: Calibration, work: Workload, actors: int, smoke: bool) -> tuple[list, dict]:
    rows = [one_row(*spec, cal, work, actors) for spec in rows_to_run(cal, work, smoke)]
    return rows, compare(rows)


def table_rows(rows: list[dict]) -> list[list[Any]]:
    return [
        [r["row"], r["tokens_per_s_sim"], r.get("vs_best_fixed", "-"), r["learner_idle_pct"],
         r["peak_buffered_tokens"], r["peak_held_tokens"] or "-", r["token_budget"] or "-",
         r["staleness_mean"], r["bound_mean"], r["bound_last"], r["steps_below_target"],
         r["steps"]]
        for r in rows
    ]  # fmt: skip


HEADERS = ["row", "tok/s (sim)", "vs best fixed", "idle %", "peak buffered tok",
           "peak held tok", "budget", "staleness", "bound mean", "bound last",
           "steps < ESS target", "steps"]  # fmt: skip

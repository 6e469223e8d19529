"""Every shipped CPU recipe over seeds, each checked against the claim in its header comment.

A recipe states what it achieves in lines of its header comment that this bench reads:

    # check: last(eval/accuracy, 3) >= 0.45; gain(eval/accuracy) >= 0.30
    # check-short: max_steps=20; gain(eval/accuracy) >= 0.10

`check:` is the claim of a full run (every seed must meet every clause); `check-short:` the
looser claim of a short run (its `key=value` parts are config overrides) that CI runs on one
seed (tests/test_recipes.py), so a recipe that stops learning fails CI the day it happens.
A clause is `<stat>(<metric>[, N]) <op> <number>`, `<op>` one of >= <= > <; the statistics
over the metric's series in metrics.jsonl (rows holding it, in step order):
  first(m, N) / last(m, N): mean of the first / last N values (N defaults to 1);
  best(m): the largest value; gain(m): last − first value; floor(m): min value ÷ first value.
Nothing is evaluated: clauses are parsed by one regular expression.

Each run is the real CLI (`asyncrl run <config> seed=<s> output_dir=<tmp>`) in a subprocess.
Writes bench/results/recipes.json (per recipe and seed: wall time, the stats, pass/fail) and
recipes.png (each recipe's first-clause metric against step, one line per seed).

    asyncrl bench recipes [--smoke] [--seeds 0 1 2] [--only default agentic_guess_number]

With `--only`, the named recipes are measured again and the others' entries are kept from the
recorded file, each stamped with when it was measured (`measured`) and the box's load.
"""

from __future__ import annotations

import json
import operator
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import finish, headline, make_parser, out_dir, print_table

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
_CLAUSE = re.compile(
    r"^(first|last|best|gain|floor)\(\s*([\w/.\-]+)\s*(?:,\s*(\d+))?\s*\)\s*(>=|<=|>|<)\s*"
    r"(-?\d+(?:\.\d+)?)$"
)
_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


@dataclass(frozen=True)
class Clause:
    stat: str
    metric: str
    n: int
    op: str
    bound: float

    def value(self, series: list[float]) -> float:
        if not series:
            raise ValueError(f"{self.metric}: no row of metrics.jsonl holds it")
        head, tail = series[: self.n], series[-self.n :]
        return {
            "first": lambda: sum(head) / len(head),
            "last": lambda: sum(tail) / len(tail),
            "best": lambda: max(series),
            "gain": lambda: series[-1] - series[0],
            "floor": lambda: min(series) / series[0] if series[0] else float("nan"),
        }[self.stat]()

    def holds(self, value: float) -> bool:
        return _OPS[self.op](value, self.bound)

    def __str__(self) -> str:
        n = f", {self.n}" if self.stat in ("first", "last") and self.n != 1 else ""
        return f"{self.stat}({self.metric}{n}) {self.op} {self.bound:g}"


@dataclass(frozen=True)
class Claim:
    clauses: tuple[Clause, ...]
    overrides: tuple[str, ...] = ()  # check-short: config overrides of the short run


def parse_clause(text: str) -> Clause:
    m = _CLAUSE.match(text.strip())
    if m is None:
        raise ValueError(f"not a claim clause: {text.strip()!r} (want e.g. 'last(m, 3) >= 0.5')")
    stat, metric, n, op, bound = m.groups()
    return Clause(stat, metric, int(n or 1), op, float(bound))


def read_claims(path: Path) -> dict[str, Claim]:
    """`{"full": Claim, "short": Claim}` from the header comment (the leading `#` lines)."""
    claims: dict[str, Claim] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        m = re.match(r"#\s*check(-short)?:\s*(.+)$", line)
        if m is None:
            continue
        parts = [p.strip() for p in m.group(2).split(";") if p.strip()]
        overrides = tuple(p for p in parts if "=" in p and not re.search(r"[<>]", p))
        clauses = tuple(parse_clause(p) for p in parts if p not in overrides)
        claims["short" if m.group(1) else "full"] = Claim(clauses, overrides)
    return claims


def series(metrics_file: Path, metric: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for line in metrics_file.read_text().splitlines():
        row = json.loads(line)
        if isinstance(row.get(metric), int | float):
            steps.append(int(row["step"]))
            values.append(float(row[metric]))
    order = sorted(range(len(steps)), key=steps.__getitem__)
    return [steps[i] for i in order], [values[i] for i in order]


def run_recipe(config: Path, seed: int, overrides: tuple[str, ...], out: Path) -> float:
    """One real run through the CLI; its wall time. A failed run raises with its last lines."""
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", str(config), f"seed={seed}",
           f"output_dir={out}", *overrides]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-8:])
        raise RuntimeError(f"{config.name} seed {seed} exited {proc.returncode}:\n{tail}")
    return time.perf_counter() - start


def check_run(claim: Claim, metrics_file: Path) -> dict[str, Any]:
    """Every clause's value on this run and whether it holds."""
    out = {}
    for clause in claim.clauses:
        value = clause.value(series(metrics_file, clause.metric)[1])
        out[str(clause)] = {"value": value, "holds": clause.holds(value)}
    return out


def measure(config: Path, claim: Claim, seeds: list[int], tmp: Path) -> dict[str, Any]:
    runs = []
    for seed in seeds:
        out = tmp / f"{config.stem}-s{seed}"
        seconds = run_recipe(config, seed, claim.overrides, out)
        metric = claim.clauses[0].metric
        steps, values = series(out / "metrics.jsonl", metric)
        checks = check_run(claim, out / "metrics.jsonl")
        runs.append({"seed": seed, "seconds": seconds, "checks": checks,
                     "curve": {"metric": metric, "steps": steps, "values": values}})  # fmt: skip
    passed = all(c["holds"] for r in runs for c in r["checks"].values())
    return {"config": config.name, "overrides": list(claim.overrides), "passed": passed,
            "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_1m": os.getloadavg()[0],
            "runs": runs}  # fmt: skip


def merge_recorded(recipes: list[dict[str, Any]], recorded: Path) -> list[dict[str, Any]]:
    """`recipes` (a re-measured subset, `--only`) with the other recipes' entries kept from the
    recorded file, in config order; a kept entry keeps when it was measured (entries from
    before the per-recipe stamp get the file's `created`)."""
    if not recorded.exists():
        return recipes
    old = json.loads(recorded.read_text())
    if old.get("smoke"):
        return recipes
    kept = {r["config"]: {"measured": old.get("created"), **r} for r in old.get("recipes", [])}
    kept.update({r["config"]: r for r in recipes})
    order = [p.name for p in recipe_configs(None)]
    return sorted(kept.values(), key=lambda r: order.index(r["config"]) if r["config"] in order
                  else len(order))  # fmt: skip


def _plot(recipes: list[dict[str, Any]]):
    def draw(fig: Any) -> None:
        axes = fig.subplots(1, max(1, len(recipes)), squeeze=False)[0]
        for ax, rec in zip(axes, recipes, strict=False):
            for run in rec["runs"]:
                c = run["curve"]
                ax.plot(c["steps"], c["values"], label=f"seed {run['seed']}")
            ax.set_title(rec["config"].removesuffix(".yaml"), fontsize=8)
            ax.set_xlabel("step")
            ax.set_ylabel(rec["runs"][0]["curve"]["metric"] if rec["runs"] else "")
            ax.legend(fontsize=6)

    return draw


def recipe_configs(only: list[str] | None) -> list[Path]:
    found = [p for p in sorted(CONFIGS.glob("*.yaml")) if read_claims(p)]
    if only:
        found = [p for p in found if p.stem in only]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--only", nargs="+", default=None, help="config stems to run")
    args = parser.parse_args(argv)
    seeds = args.seeds or ([0] if args.smoke else [0, 1, 2])
    recipes = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-recipes-") as tmp:
        for config in recipe_configs(args.only):
            claim = read_claims(config)["short" if args.smoke else "full"]
            recipes.append(measure(config, claim, seeds, Path(tmp)))
    if args.only and not args.smoke:  # the other recipes' last measurements stay in the file
        recipes = merge_recorded(recipes, out_dir(args) / "recipes.json")
    rows = [[rec["config"], run["seed"], run["seconds"], clause, c["value"],
             "ok" if c["holds"] else "FAILED"]
            for rec in recipes for run in rec["runs"] for clause, c in run["checks"].items()]  # fmt: skip
    print_table("recipe claims", ["config", "seed", "s", "claim", "value", ""], rows)
    passed = sum(rec["passed"] for rec in recipes)
    result = {"seeds": seeds, "recipes": recipes,
              "headline": {"recipes_passed_frac": headline(passed / max(1, len(recipes)))}}  # fmt: skip
    finish("recipes", result, args, _plot(recipes), argv)
    return 0 if passed == len(recipes) else 1

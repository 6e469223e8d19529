"""The end-of-run summary: one flat dict (written as `summary.json`) and a rich table.

Every entry is a number or null: null means the run never logged what it is computed from.
Accuracies are fractions; `eval_gain_points` is (last − first) × 100.
"""

from __future__ import annotations

import math
from statistics import fmean
from typing import IO, Any

from asyncrl.metrics import keys
from asyncrl.metrics.history import History

#: Steps averaged at each end of the run for `reward_first` / `reward_last`.
EDGE_STEPS = 5


def _mean(values: list[float]) -> float | None:
    return fmean(values) if values else None


def _eval_stats(history: History) -> dict[str, float | None]:
    acc = history.values(keys.ACCURACY)
    first, last = (acc[0], acc[-1]) if acc else (None, None)
    return {
        "eval_first": first,
        "eval_last": last,
        "eval_best": max(acc) if acc else None,
        "eval_gain_points": None if not acc else 100 * (last - first),
        "eval_count": len(acc),
    }


def _groups_trained(history: History, hist: dict[int, int]) -> float | None:
    taken = history.latest_finite(keys.TAKEN)
    if taken is not None:
        return taken
    return float(sum(hist.values())) if hist else None


def summarize(history: History, wall_time_s: float) -> dict[str, Any]:
    """The summary of a run; robust to a run with no steps or missing metrics."""
    rewards = history.values(keys.REWARD)
    idle = _mean(history.values(keys.IDLE_FRAC))
    hist = history.staleness_hist()
    return {
        "steps": len(history.steps),
        "last_step": history.steps[-1] if history.steps else None,
        "wall_time_s": round(wall_time_s, 3),
        **_eval_stats(history),
        "reward_first": _mean(rewards[:EDGE_STEPS]),
        "reward_last": _mean(rewards[-EDGE_STEPS:]),
        "tokens_per_s_mean": _mean(history.values(keys.TOKENS_PER_S)),
        "learner_idle_pct": None if idle is None else 100 * idle,
        "sync_seconds_mean": _mean(history.values(keys.SYNC_SECONDS)),
        "groups_trained": _groups_trained(history, hist),
        "groups_evicted": history.latest_finite(keys.EVICTED),
        "groups_over_bound": history.latest_finite(keys.OVER_BOUND),
        "length_ratio": history.latest_finite(keys.LENGTH_RATIO),
        "mismatch_kl_mean": _mean(history.values(keys.MISMATCH_KL)),
        "first_batch_s": history.latest_finite("time/first_batch_s"),  # start -> step 1
        "staleness_hist": {str(k): n for k, n in hist.items()},
    }


def _num(value: Any, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def _rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    return [
        ("steps", f"{s['steps']}"),
        ("wall time", _num(s["wall_time_s"], ".1f", " s")),
        ("eval accuracy first → last", f"{pct(s['eval_first'])} → {pct(s['eval_last'])}"),
        ("eval accuracy best", pct(s["eval_best"])),
        ("eval gain", _num(s["eval_gain_points"], "+.1f", " points")),
        (
            f"reward first → last {EDGE_STEPS} steps",
            f"{_num(s['reward_first'], '.3f')} → {_num(s['reward_last'], '.3f')}",
        ),
        ("tokens/s (mean)", _num(s["tokens_per_s_mean"], ",.0f")),
        ("learner idle", _num(s["learner_idle_pct"], ".1f", "%")),
        ("sync seconds (mean)", _num(s["sync_seconds_mean"], ".3f")),
        ("groups trained", _num(s["groups_trained"], ".0f")),
        ("groups evicted", _num(s["groups_evicted"], ".0f")),
        ("groups trained past max_staleness", _num(s["groups_over_bound"], ".0f")),
        ("trained ÷ generated length", _num(s["length_ratio"], ".3f")),
        ("mismatch KL (mean)", _num(s["mismatch_kl_mean"], ".2e")),
        ("staleness k:groups", " ".join(f"{k}:{n}" for k, n in s["staleness_hist"].items()) or "-"),
    ]


def print_summary(summary: dict[str, Any], stream: IO[str], title: str = "run summary") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for label, text in _rows(summary):
        table.add_row(label, text)
    Console(file=stream).print(table)

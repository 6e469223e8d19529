"""The transport's cost per trajectory against the engine's time to generate it, per shipped
recipe (a helper module of `asyncrl bench transport`: no bench of its own).

The transport's CPU per group (sender + receiver processes: encode, send, receive, decode,
validate; `codec_zmq` at the bench's batch) is measured at 1k, 4k and 16k response tokens per
group and fitted as a + b · tokens (least squares); a recipe's trajectory costs
fit(n · R) / n, with n its group size and R its response length (`max_new_tokens`, else
`response_length`). The engine's time for that trajectory is R / its aggregate decode rate:
for the CPU recipes (the hf engine) the rate `asyncrl bench rollout` measured
(`hf_peak_tokens_per_s` in bench/results/rollout.json); for the SGLang recipes a stated rate
(`--gpu-tokens-per-s`), chosen high on purpose: a faster engine leaves the transport a larger
share, so the ratio is an upper bound for engines slower than it. Target: <= 1 %.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import numpy as np

TARGET = 0.01
ROOT = Path(__file__).resolve().parents[1]


def fit(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """(a, b): CPU µs per group = a + b · response tokens, from the measured rows."""
    tokens = np.array([r["tokens"] for r in rows], float)
    cpu = np.array([r["codec_zmq"]["cpu_us_per_group"] for r in rows], float)
    b, a = np.polyfit(tokens, cpu, 1) if len(rows) > 1 else (cpu[0] / tokens[0], 0.0)
    return float(a), float(b)


def recipe_shapes() -> list[dict[str, Any]]:
    """Each shipped recipe's engine kind, group size and response length."""
    from asyncrl.config import load_config

    out = []
    for path in sorted(glob.glob(str(ROOT / "configs" / "*.yaml"))):
        cfg = load_config(path, [])
        infer = cfg.actor_infer
        resp = infer.generating_args.max_new_tokens or cfg.response_length
        out.append({"recipe": Path(path).name, "engine": infer.strategy_args.strategy_name,
                    "n": cfg.num_return_sequences_in_group, "response_tokens": int(resp)})  # fmt: skip
    return out


def cpu_engine_rate() -> tuple[float, str]:
    """The hf engine's measured aggregate tokens/s and where it comes from."""
    path = ROOT / "bench" / "results" / "rollout.json"
    data = json.loads(path.read_text())
    rate = float(data["headline"]["hf_peak_tokens_per_s"]["value"])
    return rate, f"bench/results/rollout.json ({data.get('created', '?')[:10]})"


def cost_table(rows: list[dict[str, Any]], gpu_tokens_per_s: float) -> dict[str, Any]:
    """Per recipe: transport µs per trajectory, engine seconds per trajectory, their ratio."""
    a, b = fit(rows)
    cpu_rate, cpu_source = cpu_engine_rate()
    table = []
    for shape in recipe_shapes():
        n, resp = shape["n"], shape["response_tokens"]
        transport_us = max(a + b * n * resp, 0.0) / n
        rate = cpu_rate if shape["engine"] == "hf_infer" else gpu_tokens_per_s
        engine_s = resp / rate
        table.append({**shape, "transport_us": transport_us, "engine_tokens_per_s": rate,
                      "engine_ms": engine_s * 1e3,
                      "ratio": transport_us * 1e-6 / engine_s})  # fmt: skip
    worst = max(r["ratio"] for r in table)
    return {"fit_us": {"a": a, "b_per_token": b}, "cpu_engine_source": cpu_source,
            "gpu_tokens_per_s": gpu_tokens_per_s, "rows": table, "worst": worst,
            "target": TARGET, "met": worst <= TARGET}  # fmt: skip


def print_cost(cost: dict[str, Any]) -> None:
    from common import print_table

    print_table(
        f"transport CPU per trajectory / the engine's generation time for it (target <= "
        f"{100 * TARGET:.0f} %); hf engine rate from {cost['cpu_engine_source']}, SGLang "
        f"recipes at a stated {cost['gpu_tokens_per_s']:.0f} tok/s",
        ["recipe", "engine", "n", "resp tokens", "transport us", "engine ms", "ratio %"],
        [[r["recipe"], r["engine"], r["n"], r["response_tokens"], r["transport_us"],
          r["engine_ms"], 100 * r["ratio"]] for r in cost["rows"]],
    )  # fmt: skip

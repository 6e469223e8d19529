"""The shared-prompt part of `asyncrl bench train --shared-prompt` (a helper module: no bench of
its own): fwd + bwd of the learner's training forward (logprobs and entropy of every response
token, a masked policy-gradient loss, backward) on one micro-batch of one group (`--n` rows,
a `P`-token prompt, `R`-token responses of equal length: no padding, the whole forward's best
case, SDPA's causal kernel; `--ragged`: lengths uniform in [R/2, R], padding, so the whole
forward attends under a mask too) at several (P, R) shapes, by path:

- shared, mask: each group's prompt once, the responses under a mask over [prompt | response]
  keys (the lean forward; what `actor.share_prompt_forward` always ran before the rule);
- shared, causal: the same with the responses laid out for SDPA's causal kernel (lean only);
- whole: every row's prompt and response in one transformers forward;
- auto: the rule the learner runs (`learner/prompt_rule.py`) over the three;
- hf shared / hf auto: transformers' shared-prompt forward, and the rule over it and whole
  (what an FSDP2 or compiled learner runs).

Each repeat runs every path once, interleaved (the box's load moves between repeats, not
between paths); a figure is the least of the repeats' process CPU seconds (one torch thread:
the CPU time of the work, robust to a shared box's descheduling; the least, the run the other
work disturbed least), beside the medians and the wall seconds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.learner import lean
from asyncrl.learner import logprobs as lp
from asyncrl.learner import prompt_rule as pr

SHAPES = [(32, 1024), (64, 512), (256, 256), (512, 128), (1024, 64)]
SMOKE_SHAPES = [(8, 64), (64, 8)]


def _batch(prompt: int, response: int, n: int, vocab: int, ragged: bool) -> dict[str, torch.Tensor]:
    import _train_scale as scale

    from asyncrl.learner.collate import collate

    scale.PROMPT_LEN, before = prompt, scale.PROMPT_LEN
    try:
        lengths = (
            (lambda rng: rng.integers(response // 2, response + 1, n))
            if ragged
            else (lambda rng: np.full(n, response))
        )
        groups = scale.synthetic_groups(1, vocab, lengths, "shared")
    finally:
        scale.PROMPT_LEN = before
    data = collate(groups, 0).to_torch("cpu")
    data["response_mask"] = data["response_mask"].float()
    return data


def _paths(model: torch.nn.Module) -> dict[str, Callable]:
    fn = lean.lean_shared_logits_for(model)
    assert fn is not None, "the bench model is one the lean forward takes"

    def causal(m: torch.nn.Module, t: dict[str, torch.Tensor]) -> Any:
        return fn(m, t, causal=True)

    lean_paths = {pr.SHARED: fn, pr.SHARED_CAUSAL: causal, pr.WHOLE: lp.response_logits}
    hf_paths = {pr.SHARED: lp.shared_prompt_logits, pr.WHOLE: lp.response_logits}
    return {
        "shared, mask": fn, "shared, causal": causal, "whole": lp.response_logits,
        "auto": pr.SharedPromptRule(model, lean_paths, agree=False),
        "hf shared": lp.shared_prompt_logits,
        "hf auto": pr.SharedPromptRule(model, hf_paths, agree=False),
    }  # fmt: skip


def _step(
    model: torch.nn.Module, fn: Callable, data: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one fwd + bwd."""
    model.zero_grad(set_to_none=True)
    cpu, wall = time.process_time(), time.perf_counter()
    logp, ent = lp.token_logprobs(model, data, 1.0, True, False, fn)
    ((logp - 1e-3 * ent) * data["advantages"] * data["response_mask"]).sum().backward()
    return time.process_time() - cpu, time.perf_counter() - wall


def measure(
    model_dir: Path, n: int, repeats: int, smoke: bool, ragged: bool = False
) -> dict[str, Any]:
    """Per shape: each path's median seconds, the rules' choices, auto vs the best path."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    vocab = int(model.config.vocab_size)
    paths = _paths(model)
    load = [os.getloadavg()[0]]
    rows = []
    for prompt, response in SMOKE_SHAPES if smoke else SHAPES:
        data = _batch(prompt, response, n, vocab, ragged)
        cpu: dict[str, list[float]] = {k: [] for k in paths}
        wall: dict[str, list[float]] = {k: [] for k in paths}
        for rep in range(repeats + 1):  # the first: warm-up
            for name, fn in paths.items():
                c, w = _step(model, fn, data)
                if rep:
                    cpu[name].append(c)
                    wall[name].append(w)
        med = {k: float(np.min(v)) for k, v in cpu.items()}
        fixed = ("shared, mask", "shared, causal", "whole")
        rows.append({
            "prompt": prompt, "response": response, "n": n, "cpu_s": med,
            "cpu_s_median": {k: float(np.median(v)) for k, v in cpu.items()},
            "wall_s": {k: float(np.median(v)) for k, v in wall.items()},
            "auto_path": paths["auto"].choose(data), "hf_auto_path": paths["hf auto"].choose(data),
            "auto_vs_best": med["auto"] / min(med[k] for k in fixed),
            "hf_auto_vs_best": med["hf auto"] / min(med["hf shared"], med["whole"]),
            "mask_vs_whole": med["shared, mask"] / med["whole"],
        })  # fmt: skip
        load.append(os.getloadavg()[0])
    return {"rows": rows, "load_avg_1min": load, "repeats": repeats, "n": n, "ragged": ragged}


def print_result(m: dict[str, Any], print_table: Callable) -> None:
    print_table(
        f"shared-prompt forward, fwd + bwd of one group of {m['n']} rows, "
        f"{'ragged (R/2..R)' if m['ragged'] else 'equal'} response lengths "
        f"(least CPU s of {m['repeats']}; 1-min load {min(m['load_avg_1min']):.1f}-"
        f"{max(m['load_avg_1min']):.1f})",
        ["P / R", "shared,mask", "shared,causal", "whole", "auto", "auto path", "auto/best",
         "hf shared", "hf auto", "hf auto path", "hf auto/best"],
        [[f"{r['prompt']}/{r['response']}", r["cpu_s"]["shared, mask"],
          r["cpu_s"]["shared, causal"], r["cpu_s"]["whole"], r["cpu_s"]["auto"], r["auto_path"],
          r["auto_vs_best"], r["cpu_s"]["hf shared"], r["cpu_s"]["hf auto"], r["hf_auto_path"],
          r["hf_auto_vs_best"]] for r in m["rows"]],
    )  # fmt: skip

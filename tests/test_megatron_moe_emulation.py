"""The Megatron learner on the embedded tiny Qwen3-MoE (Megatron's MoE layers, SequentialMLP
experts, the all-to-all dispatcher) against the torch learner, on the CPU
(tests/megatron_moe_emulation.py): expert parallel over two ranks, data parallel with every
expert on each rank, one rank, and routing replay (r3) through megatron-core's router-replay
hook. Each case: per-token logprobs and one step's loss metrics within 1e-5, the weights after
the step (Adam: within 1e-5; SGD, where the step is lr x the gradient: within 1e-7, so the
gradients within 1e-4), and the HF export of the loaded model equal to the checkpoint bit for
bit (router and every expert, per-expert names). r3: every (token, layer) the engine routed was
dispatched to exactly the recorded experts on the rank that ran it (without CP), and the share
of replayed token-layers whose own top-k differs is the torch learner's. The default suite runs
`QUICK`; the rest are `slow`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
HERE = Path(__file__).resolve().parent

CASES = {  # world, extra (strategy_config, plus "router_replay" and "optim")
    "ep2": (2, {"expert_model_parallel_size": 2}),
    "ep1-dp2": (2, {}),
    "one-rank": (1, {}),
    "ep2-r3-sgd": (2, {"expert_model_parallel_size": 2, "router_replay": True, "optim": "sgd"}),
    "ep2-r3": (2, {"expert_model_parallel_size": 2, "router_replay": True}),
    # context parallel: each CP rank's routers get its positions' routes (Megatron's 2·CP split)
    "cp2-ep2-r3-sgd": (
        2,
        {
            "context_parallel_size": 2,
            "expert_model_parallel_size": 2,
            "router_replay": True,
            "optim": "sgd",
        },
    ),
}
QUICK = ("ep2",)
# Adam's first step moves every weight by ~lr x sign(gradient): where a gradient is ~0 its
# sign is rounding, and r3's forced experts leave more of those (measured 1.7e-5 against 3e-6
# without replay; with SGD the same run agrees within 1.5e-8)
WEIGHT_TOL = {"ep2-r3-sgd": 1e-7, "cp2-ep2-r3-sgd": 1e-7, "ep2-r3": 5e-5}


def run_case(tmp_path: Path, world: int, extra: dict) -> dict:
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(HERE / "megatron_moe_emulation.py"), str(out), str(world),
           json.dumps(extra)]  # fmt: skip
    path = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": path})  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=() if c in QUICK else pytest.mark.slow) for c in CASES]
)
def test_megatron_moe_matches_the_torch_learner(tmp_path, case):
    world, extra = CASES[case]
    result = run_case(tmp_path, world, dict(extra))
    assert result["roundtrip_exact"] is True  # load HF -> export HF: the same tensors, names
    assert result["logprob_max_diff"] < 1e-5
    for key, (want, got) in result["metrics"].items():
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), key
    assert result["names_match"]
    assert result["weight_change"] > 1e-6  # the step moved the weights
    assert result["weight_max_diff"] < WEIGHT_TOL.get(case, 1e-5), result["worst_weights"]
    if extra.get("router_replay"):
        replay = result["replay"]
        if "checked" in replay:  # the dispatched experts (not laid out under CP)
            assert replay["wrong"] == 0 and replay["checked"] == replay["recorded"] > 100, replay
            assert replay["unrun_real_tokens"] == 0
        assert replay["torch_differ_frac"] > 0.3  # the replayed routes were not the own ones
        # the Megatron learner's metric of the same (the passes differ in number, not in kind)
        assert replay["megatron_differ_frac"] == pytest.approx(replay["torch_differ_frac"],
                                                               abs=0.02)  # fmt: skip

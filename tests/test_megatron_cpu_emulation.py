"""The real Megatron learner (megatron-core 0.16) on the CPU, two ranks, against the torch
learner: tensor parallel with a padded vocabulary, pipeline parallel, data parallel with the
distributed optimizer, and data parallel with a batch-level advantage estimator (REINFORCE++:
each rank must whiten over the whole batch, not its shard). Megatron's CUDA-only calls are
redirected (tests/megatron_emulation.py); skipped when megatron-core is not installed. The GPU
runs live in tests/gpu/.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
HERE = Path(__file__).resolve().parent

CASES = {
    "tp2-padded-vocab": (2, 1, "101", {}),
    "pp2-untied": (1, 2, "-", {}),
    "dp2-distributed-optimizer": (1, 1, "-", {"use_distributed_optimizer": True,
                                              "overlap_grad_reduce": True}),
    "dp2-reinforce-plus-plus": (1, 1, "-", {"algorithm": {"adv_estimator":
                                                          "reinforce_plus_plus", "gamma": 0.9}}),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_match_the_torch_learner(tmp_path, tiny_model, case):
    tp, pp, vocab, extra = CASES[case]
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(HERE / "megatron_emulation.py"), str(tiny_model), str(out),
           str(tp), str(pp), vocab, json.dumps(extra)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["logprob_max_diff"] < 2e-5
    for key, (want, got) in result["metrics"].items():
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), key
    assert result["weight_max_diff"] < 1e-5
    assert not result["silent_ranks_exported"]  # only global rank 0 yields tensors
    assert "model.embed_tokens.weight" in result["exported"]
    assert ("lm_head.weight" in result["exported"]) == (pp == 2)  # tied when pp == 1

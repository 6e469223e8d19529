"""`asyncrl bench shape`'s arithmetic: the model FLOPs it divides by (the parameter count of the
model it builds, the attention term) and the figures it derives from a row's seconds. Its smoke
run through the CLI is in test_bench_smoke.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import _shape_parts as parts  # noqa: E402
import shape  # noqa: E402

SMALL = {**parts.QWEN25_1_5B, "hidden": 64, "intermediate": 160, "layers": 3, "heads": 4,
         "kv_heads": 2, "vocab": 300}  # fmt: skip


def test_body_params_is_the_built_models_non_embedding_count():
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(parts.qwen2_config(SMALL))
    total = sum(p.numel() for p in model.parameters())  # the tied head counted once
    embedding = model.get_input_embeddings().weight.numel()
    assert parts.body_params(SMALL) == total - embedding
    assert model.config.tie_word_embeddings and model.config.rope_parameters["rope_theta"] == 1e6


def test_qwen25_body_params():
    """Qwen2.5-1.5B's model card: 1.54 B parameters, 1.31 B of them non-embedding."""
    body = parts.body_params(parts.QWEN25_1_5B)
    assert body == pytest.approx(1.31e9, rel=4e-3)
    assert body + 151_936 * 1536 == pytest.approx(1.54e9, rel=4e-3)


def test_step_flops_dense_and_attention_terms():
    real, resp = np.array([10, 30]), np.array([6, 20])
    got = parts.step_flops(SMALL, real, resp)
    n_body, h = parts.body_params(SMALL), SMALL["hidden"]
    assert got["dense"] == 6 * (n_body * 40 + SMALL["vocab"] * h * 26)
    # 12 layers H L / 2 per token: a sequence of L tokens costs 6 layers H L^2
    assert got["attention"] == 12 * 3 * h * (10 * 10 / 2 + 30 * 30 / 2)


def test_make_groups_lengths_stay_within_the_sequence_length():
    groups = parts.make_groups(2, 5, 256, 1000)
    real, resp = parts.batch_lengths(groups)
    assert len(real) == 10 and real.max() <= 256 and real.min() >= 256 * 7 // 8
    assert (real - resp == 32).all()  # bench/_train_scale's prompt
    with pytest.raises(ValueError, match="--seq-len 16"):
        parts.make_groups(1, 1, 16, 1000)


def test_figures_mfu_ratio_and_recompute():
    """MFU with and without attention; x bare is the ratio of model FLOP/s at the same budget
    (the bypass learner's time ratio); a recompute row counts a third more of both terms."""
    ctx = {"peak": 1e12, "tokens": 100.0, "flops": {"dense": 3e12, "attention": 1e12}}
    rows = [
        {"path": "learner bypass", "budget": 8, "seconds": 8.0},
        {"path": "bare fwd+bwd+AdamW", "budget": 8, "seconds": 5.0},
        {"path": "learner decoupled", "budget": 8, "seconds": 10.0, "recompute": True},
        {"path": "bare fwd+bwd+AdamW", "budget": 4, "status": "OOM"},
        {"path": "learner bypass", "budget": 4, "seconds": 4.0},
    ]
    shape._figures(rows, ctx)
    assert rows[0]["mfu"] == pytest.approx(0.5) and rows[0]["mfu_no_attention"] == pytest.approx(
        3 / 8
    )
    assert rows[0]["x_bare"] == pytest.approx(5 / 8)
    assert rows[2]["tflops"] == pytest.approx(4 * 4 / 3 / 10)
    assert rows[2]["x_bare"] == pytest.approx((16 / 30) / (4 / 5))
    assert rows[4]["x_bare"] is None and "mfu" not in rows[3]  # its bare ran out of memory
    lines = shape.target_lines(rows)
    assert "50.0 % (met)" in lines[0] and "0.625x (MISSED)" in lines[0]
    assert "bare did not run" in lines[1]


def test_cpu_sizes_fill_only_what_the_flags_leave(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = shape.parse(["--hidden", "256", "--budget", "512"])
    assert (args.hidden, args.intermediate, args.heads, args.kv_heads) == (256, 1493, 2, 2)
    assert (args.layers, args.vocab, args.budget, args.seq_len) == (2, 151_936, 512, 512)
    assert shape.shape_of(args)["rope_theta"] == 1e6

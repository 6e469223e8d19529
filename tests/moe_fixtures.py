"""A random tiny Qwen3-MoE model directory (the embedded tokenizer, no warm start) for tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from asyncrl.models.tiny import TinyModelSpec, build_model, build_tokenizer

#: 8 experts, top-2, 2 layers, width 32: a forward is milliseconds.
SMALL_MOE = TinyModelSpec(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    max_position_embeddings=2048, arch="moe", num_experts=8, experts_per_token=2,
    moe_intermediate_size=16,
)  # fmt: skip


def random_moe(path: Path | None = None, seed: int = 0, router_std: float = 0.5):
    """The model (saved with the tokenizer to `path` when given). `router_std`: the routers'
    weights re-drawn wider than the init's, so routing is decided, not a near-tie everywhere."""
    import torch

    tok = build_tokenizer()
    model = build_model(dataclasses.replace(SMALL_MOE, seed=seed), tok).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            p.data = torch.randn(p.shape, generator=gen) * router_std
    if path is not None:
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return model

"""Shared test fixtures: tiny models built locally (no hub), fast to create."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """An HF model directory with the embedded character tokenizer and a random tiny Qwen2."""
    from asyncrl.models.tiny import TinyModelSpec, build_model, build_tokenizer

    path = tmp_path_factory.mktemp("tiny-model")
    tok = build_tokenizer()
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4)
    build_model(spec, tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path

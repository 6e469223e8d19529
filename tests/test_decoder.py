"""The hf engine's lean decoder forward (`engine/hf/decoder.py`): the same logits and KV as
transformers' forward on prefill (left padding) and decode (rows retiring and joining), on
Qwen2 (GQA, q/k/v bias) and Llama (attention bias, untied head) in fp32 and bf16; models it
does not reproduce exactly are left to transformers."""

from __future__ import annotations

import pytest
import torch
from helpers import random_qwen2
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from asyncrl.engine.hf.batch import KVBatch, Seq, merge
from asyncrl.engine.hf.decoder import lean_forward_for
from asyncrl.engine.hf.lanes import Lane


def _llama(**extra) -> torch.nn.Module:
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=64, max_position_embeddings=256,
        attention_bias=True, tie_word_embeddings=False, **extra,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    for p in model.parameters():  # biases are zero at init: make them count
        p.data.normal_(0, 0.2)
    return model


def _lanes(model: torch.nn.Module) -> tuple[Lane, Lane]:
    lean, reference = Lane(model, "v"), Lane(model, "v")
    assert lean._lean is not None
    reference._lean = None  # transformers' own forward
    return lean, reference


def _seqs(prompts: list[list[int]]) -> list[Seq]:
    return [Seq(rid=str(i), prompt=p, params=None, on_done=None) for i, p in enumerate(prompts)]


def _decode(lane: Lane, batch: KVBatch, steps: int) -> list[torch.Tensor]:
    lane.batch, out = batch, []
    for _ in range(steps):
        logits = lane.decode()
        lane.batch.last = logits.argmax(-1)  # greedy: both lanes follow the same tokens
        out.append(logits)
    return out


def _run(lane: Lane) -> tuple[list[torch.Tensor], KVBatch]:
    with torch.inference_mode():
        batch, first = lane.prefill(_seqs([[5, 6, 7], [8, 9], [10, 11, 12, 13], [8, 9]]))
        batch.last = first.argmax(-1)
        got = [first, *_decode(lane, batch, 4)]
        batch = lane.batch.select([0, 2])  # rows retire
        got += _decode(lane, batch, 3)
        joined, head = lane.prefill(_seqs([[14, 15, 16, 17, 18]]))
        joined.last = head.argmax(-1)
        got += [head, *_decode(lane, merge(lane.batch, joined), 6)]  # a row joins
        return got, lane.batch


def _real_kv(batch: KVBatch) -> list[torch.Tensor]:
    """Each layer's keys and values at the unmasked positions (padding's are never read)."""
    keep = batch.mask.bool()[:, None, :, None]
    return [t.masked_fill(~keep, 0.0) for kv in batch.kv for t in kv]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_forward_equals_transformers_on_prefill_and_decode(arch, dtype):
    model = (random_qwen2(init_std=0.2) if arch == "qwen2" else _llama()).to(dtype)
    lean, reference = _lanes(model)
    got, got_batch = _run(lean)
    want, want_batch = _run(reference)
    tol = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **tol)
    assert torch.equal(got_batch.mask, want_batch.mask)
    for a, b in zip(_real_kv(got_batch), _real_kv(want_batch), strict=True):
        torch.testing.assert_close(a, b, **tol)


def test_repeated_kv_heads_path_equals_transformers(monkeypatch):
    """Where SDPA's own GQA is not used (torch 2.4, CUDA with a mask), K/V heads are repeated
    for the query heads: the same logits."""
    from asyncrl import llama

    monkeypatch.setattr(llama, "NATIVE_GQA", False)
    lean, reference = _lanes(random_qwen2(init_std=0.2))  # GQA: 4 query heads, 2 K/V heads
    for a, b in zip(_run(lean)[0], _run(reference)[0], strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_padding_rows_stay_finite():
    """A padding query attends to itself only: its outputs (never read) are finite, so they
    cannot turn a real row's attention sums into NaN at the next layer."""
    lean, _ = _lanes(random_qwen2(init_std=0.2))
    with torch.inference_mode():
        batch, logits = lean.prefill(_seqs([[5], [6, 7, 8, 9, 10, 11]]))
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(t).all() for kv in batch.kv for t in kv)


def test_models_it_does_not_reproduce_are_left_to_transformers():
    assert lean_forward_for(_llama(rope_scaling={"rope_type": "linear", "factor": 2.0})) is None
    assert lean_forward_for(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2))) is None

    class Adapted(torch.nn.Linear):  # a wrapper computing more than weight and bias say
        pass

    wrapped = random_qwen2()
    old = wrapped.model.layers[0].self_attn.q_proj
    wrapped.model.layers[0].self_attn.q_proj = Adapted(old.in_features, old.out_features)
    assert lean_forward_for(wrapped) is None
    hooked = random_qwen2()
    hooked.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert lean_forward_for(hooked) is None
    assert lean_forward_for(random_qwen2()) is not None


def test_weights_loaded_in_place_are_used_at_once():
    """Nothing is copied or fused: a weight update into the model's parameters shows in the
    very next forward (the engine's live lane is updated that way)."""
    model = random_qwen2(init_std=0.2)
    lean, reference = _lanes(model)
    with torch.inference_mode():
        model.model.layers[0].mlp.up_proj.weight.mul_(-1.5)
        got = lean.prefill(_seqs([[3, 4, 5]]))[1]
        want = reference.prefill(_seqs([[3, 4, 5]]))[1]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)

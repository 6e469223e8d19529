"""Varlen attention on packed rows (`asyncrl.learner.varlen`): each sequence attends only to
itself, equal to the padded path in values and gradients (fp32, the CPU's per-sequence path),
padded forwards of the same model unchanged, and the models it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_packing import TEMPERATURE, _data, _groups

from asyncrl.learner import logprobs as lp
from asyncrl.learner import packing, varlen


def _model(path, impl="sdpa", **config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, **config)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
def test_per_sequence_attention_equals_a_block_diagonal_causal_mask(heads, kv_heads):
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 3]
    total, dim = sum(lengths), 8
    q = torch.randn(1, heads, total, dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, total, dim, generator=gen) for _ in range(2))
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (seq[:, None] == seq[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    group = heads // kv_heads
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), mask[None, None]
    )[0].transpose(0, 1)
    got = varlen.per_sequence(q, k, v, cu, None)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="do not cover the row's 18 tokens"):
        varlen.per_sequence(q, k, v, cu[:-1], None)


def test_packed_logprobs_and_gradients_through_varlen_equal_the_padded_path(tiny_model):
    """fp32: the packed forward (one row, varlen attention) gives the padded batch's logprobs
    and entropy and the same parameter gradients, within 1e-5."""
    padded_model, packed_model = _model(tiny_model), _model(tiny_model)
    data = _data(_groups(long_row=True))
    want, want_ent = lp.token_logprobs(padded_model, data, TEMPERATURE, with_entropy=True)
    got, got_ent = lp.token_logprobs(packed_model, data, TEMPERATURE, True, packed=True)
    assert packed_model.config._attn_implementation == varlen.NAME
    assert padded_model.config._attn_implementation == "sdpa"
    real = data["attention_mask"][:, -want.shape[1] :].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(got_ent[real], want_ent[real], atol=1e-5, rtol=0)
    weights = torch.linspace(-1, 1, real.numel()).view(real.shape) * real
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    for (name, a), b in zip(
        padded_model.named_parameters(), packed_model.parameters(), strict=True
    ):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=0, msg=name)


def test_packed_forward_builds_no_dense_mask_and_one_row(tiny_model):
    model = _model(tiny_model)
    data = _data(_groups())
    assert packing.one_row(model)
    packed = packing.pack(data, one_row=True)
    lengths = packing.real_lengths(data["attention_mask"])
    assert packed.input_ids.shape == (1, sum(lengths))
    assert packed.cu_seq_lens.tolist()[-1] == sum(lengths) and packed.max_len == max(lengths)
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((attention_mask, kwargs.get(varlen.CU_SEQ)))
        return varlen.attention_forward(module, query, key, value, attention_mask, **kwargs)

    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(varlen.NAME, spy)
    try:
        packing.forward(model, packed)
    finally:
        AttentionInterface.register(varlen.NAME, varlen.attention_forward)
    assert len(seen) == model.config.num_hidden_layers
    assert all(mask is None and cu is packed.cu_seq_lens for mask, cu in seen)


def test_padded_forwards_of_a_switched_model_are_unchanged(tiny_model):
    """After the switch, the padded path (padding mask, no boundaries) runs sdpa as before."""
    reference, model = _model(tiny_model), _model(tiny_model)
    assert varlen.enable(model) and varlen.enable(model)  # idempotent
    data = _data(_groups())
    kwargs = {k: data[k] for k in ("input_ids", "attention_mask", "position_ids")}
    want = reference(**kwargs, use_cache=False).logits
    got = model(**kwargs, use_cache=False).logits
    real = data["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-6, rtol=0)


def test_checkpointed_layers_recompute_with_varlen_attention(tiny_model):
    """Activation checkpointing re-runs the layers in the backward: the switch is permanent, so
    the recomputation attends per sequence too and the gradients equal the padded path's."""
    padded_model, packed_model = _model(tiny_model), _model(tiny_model)
    for m in (padded_model, packed_model):
        enable = (
            getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable
        )
        enable()  # as the learner calls it (`learner/torch/policy.py`)
        m.train()
    data = _data(_groups(seed=3))
    want, _ = lp.token_logprobs(padded_model, data, TEMPERATURE)
    got, _ = lp.token_logprobs(packed_model, data, TEMPERATURE, packed=True)
    real = data["attention_mask"][:, -want.shape[1] :].bool()
    want[real].sum().backward()
    got[real].sum().backward()
    for a, b in zip(padded_model.parameters(), packed_model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=0)


def test_models_it_does_not_reproduce_keep_transformers_attention(tiny_model):
    assert varlen.why_not(_model(tiny_model, "eager")) == "attention implementation 'eager'"
    sliding = _model(tiny_model, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert varlen.why_not(sliding) == "sliding-window attention"
    assert not varlen.enable(sliding) and sliding.config._attn_implementation == "sdpa"

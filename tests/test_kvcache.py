"""The hf engine's in-place KV cache (`engine/hf/kvcache.py`): appends write into the buffer's
room and never into storage another tensor shows; decoding through it gives exactly what
transformers' DynamicCache gives, across rows retiring and joining."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from asyncrl.engine.hf.batch import KVBatch, Seq, merge
from asyncrl.engine.hf.kvcache import append, capacity, decode_cache


def test_append_writes_into_the_room_and_reallocates_with_as_much_again_when_full():
    view = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    assert capacity(view) == 4  # a whole tensor: no room
    grown = append(view, torch.ones(2, 3, 1, 5))
    assert grown.shape == (2, 3, 5, 5) and capacity(grown) == 10
    assert torch.equal(grown[:, :, :4], view) and (grown[:, :, 4] == 1).all()
    again = append(grown, torch.full((2, 3, 2, 5), 2.0))
    assert again.data_ptr() == grown.data_ptr()  # written in place
    assert torch.equal(again[:, :, :5], grown) and (again[:, :, 5:] == 2).all()


def test_a_view_that_is_not_a_buffer_prefix_is_copied_never_written_past():
    base = torch.zeros(2, 3, 8, 5)
    shifted = base[:, :, 2:6]  # columns 6.. belong to base: no room for it
    assert capacity(shifted) == 4
    out = append(shifted, torch.ones(2, 3, 1, 5))
    assert out.data_ptr() != base.data_ptr() and (base == 0).all()
    rows = base.index_select(0, torch.tensor([1]))[:, :, :3]  # a prefix of a fresh tensor
    assert capacity(rows) == 8


def _decode(model, batch: KVBatch, steps: int, fast: bool) -> list[torch.Tensor]:
    out = []
    for _ in range(steps):
        mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.seqs), 1)], dim=1)
        cache = decode_cache(batch.kv) if fast else DynamicCache(batch.kv)
        res = model(
            input_ids=batch.last[:, None], attention_mask=mask, position_ids=batch.pos[:, None],
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        batch.kv = [(layer.keys, layer.values) for layer in res.past_key_values.layers]
        batch.mask, batch.pos = mask, batch.pos + 1
        batch.last = res.logits[:, -1].argmax(-1)
        out.append(res.logits[:, -1])
    return out


def _prefill(model, prompts: list[list[int]]) -> KVBatch:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    kv = [(layer.keys, layer.values) for layer in res.past_key_values.layers]
    seqs = [Seq(rid=str(i), prompt=p, params=None, on_done=None) for i, p in enumerate(prompts)]
    lengths = torch.tensor([len(p) for p in prompts])
    return KVBatch(seqs, kv, mask, lengths, res.logits[:, -1].argmax(-1))


def test_decoding_through_it_equals_dynamic_cache_across_retire_and_join(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    logits = {}
    with torch.inference_mode():
        for fast in (False, True):
            batch = _prefill(model, [[5, 6, 7], [8, 9], [10, 11, 12, 13]])
            got = _decode(model, batch, 5, fast)
            batch = batch.select([0, 2])  # a row retires: new tensors, trimmed
            got += _decode(model, batch, 3, fast)
            batch = merge(batch, _prefill(model, [[14, 15]]))  # a row joins
            got += _decode(model, batch, 9, fast)
            logits[fast] = got
    for slow, fast in zip(logits[False], logits[True], strict=True):
        assert torch.equal(slow, fast)

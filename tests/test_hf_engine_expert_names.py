"""The hf engine takes a mixture-of-experts model's weights under the checkpoint's per-expert
names (`mlp.experts.<e>.gate_proj.weight` ..., what the Megatron learner exports and SGLang
loads) as well as transformers' fused ones: each lands in its slice of the fused parameter,
over a real gloo update group, flattened and per tensor."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from asyncrl.engine.hf.engine import HFEngine
from asyncrl.engine.hf.weights import WeightReceiver
from asyncrl.moe import checkpoint_tensors
from asyncrl.weights.buckets import dtype_name, flat_layout, flatten_bucket
from asyncrl.weights.group import broadcast, create_group, destroy_group, rendezvous_port


def moe_model(seed: int):
    from asyncrl.models.tiny import build_model, build_tokenizer, embedded_spec

    model = build_model(embedded_spec(arch="moe"), build_tokenizer())
    torch.manual_seed(seed)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return model.eval()


def per_expert(model) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors under checkpoint names (experts one by one), as the learners send."""
    named = ((n, p.detach()) for n, p in model.named_parameters())
    return [(n, t.contiguous().clone()) for n, t in checkpoint_tensors(named)]


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_per_expert_names_land_in_the_fused_parameters(load_format):
    engine = HFEngine(moe_model(0), max_batch_size=2)
    receiver = WeightReceiver(engine)
    target = moe_model(1)
    named = per_expert(target)
    assert any(".mlp.experts.7.down_proj.weight" in n for n, _ in named)
    port = rendezvous_port("127.0.0.1")
    with ThreadPoolExecutor(2) as pool:
        mine = pool.submit(create_group, "gloo", "127.0.0.1", port, 0, 2, "moe", 30.0)
        assert receiver.init_group("127.0.0.1", port, 1, 2, "moe", "gloo", 30.0)[0]
        group = mine.result(timeout=60)
        tensors = [t for _, t in named]
        meta = ([n for n, _ in named], [dtype_name(t.dtype) for t in tensors])
        shapes = [list(t.shape) for t in tensors]
        update = pool.submit(receiver.update, *meta, shapes, "moe", load_format, "5")
        if load_format == "flattened_bucket":
            total = flat_layout([t.dtype for t in tensors], [t.shape for t in tensors])[1]
            broadcast([flatten_bucket(tensors, torch.empty(total, dtype=torch.uint8))], group)
        else:
            broadcast(tensors, group)
        ok, message = update.result(timeout=60)
        destroy_group(group)
    assert ok, message
    want = dict(target.named_parameters())
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, want[name]), name
    assert engine.weight_version == "5"


def test_an_expert_beyond_the_model_is_an_unknown_name():
    receiver = WeightReceiver(HFEngine(moe_model(0), max_batch_size=2))
    name = "model.layers.0.mlp.experts.8.gate_proj.weight"
    problem = receiver._check([name], [torch.float32], [(128, 128)])
    assert problem and "unknown parameter name" in problem

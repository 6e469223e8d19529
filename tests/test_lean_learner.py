"""The learner's lean training forward (`learner/lean.py`): the logits and gradients of
transformers' forward (each group's prompt once, and every row whole), on Qwen2 (GQA, q/k/v
bias) and Llama (attention bias, untied head), with left-padded prompts of different lengths
and right-padded ragged responses; the learner takes it exactly where it may, and a step with
it equals a step with transformers' forward."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from helpers import random_qwen2
from test_decoder import _llama
from test_shared_prompt import _learner, _tensors, assert_same_steps, full

from asyncrl.learner import lean
from asyncrl.learner import logprobs as lp
from asyncrl.learner.torch import lean_policy


def _model(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = random_qwen2(init_std=0.2) if arch == "qwen2" else _llama()
    return model.to(dtype).train()


def _grads(model: torch.nn.Module, fn, data: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    logits = fn(model, data)
    mask = data["response_mask"]
    logp, _ = lp.score(logits, data["input_ids"][:, -mask.shape[1] :], 1.0, False)
    (logp * data["advantages"] * mask).sum().backward()
    return full(logits).detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("rows", [None, slice(1, 7), slice(3, 5)])  # (3, 5): no prompt padding
@pytest.mark.parametrize("causal", [False, True])
def test_lean_logits_and_gradients_equal_transformers(arch, rows, causal):
    model = _model(arch)
    data = _tensors(rows)
    real = data["response_mask"].bool()
    fn = lean.lean_shared_logits_for(model)
    assert fn is not None
    fn = partial(fn, causal=causal)  # the responses under a mask, or laid out causally
    got, got_grads = _grads(model, fn, data)
    for reference in (lp.shared_prompt_logits, lp.response_logits):
        want, want_grads = _grads(model, reference, data)
        assert got.shape == want.shape
        torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=2e-5)
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)
    assert torch.isfinite(got).all()  # padding positions too: never NaN into a masked sum


def test_lean_logits_equal_transformers_in_bf16():
    model = _model("qwen2", torch.bfloat16)
    data = _tensors()
    real = data["response_mask"].bool()
    with torch.no_grad():
        got = full(lean.lean_shared_logits_for(model)(model, data))
        want = full(lp.shared_prompt_logits(model, data))
    torch.testing.assert_close(got[real], want[real], rtol=2e-2, atol=2e-2)


def test_the_learner_takes_the_lean_forward_only_where_it_may(tiny_model):
    paths = _learner(tiny_model).logits_fn.paths
    assert list(paths) == ["shared", "shared, causal", "whole"]
    assert paths["shared"].func is lean._shared_prompt_logits
    assert paths["shared, causal"].keywords == {"causal": True}
    assert paths["whole"] is lp.response_logits
    assert _learner(tiny_model, "actor.share_prompt_forward=false").logits_fn is None
    # refused models and settings keep transformers' forward
    compiled = _learner(tiny_model, "actor.use_torch_compile=true")
    assert compiled.logits_fn.paths == {"shared": lp.shared_prompt_logits,
                                        "whole": lp.response_logits}  # fmt: skip
    dropout = _model("qwen2")
    dropout.config.attention_dropout = 0.1  # transformers applies it inline: not reproduced
    assert lean.lean_shared_logits_for(dropout) is None
    hooked = _model("llama")
    hooked.model.layers[0].register_forward_pre_hook(lambda *a: None)  # FSDP2 gathers in hooks
    assert lean.lean_shared_logits_for(hooked) is None


def test_a_lean_learner_step_equals_transformers_step(tiny_model, monkeypatch):
    lean_learner = _learner(tiny_model)
    # transformers' model and forward (the policy read without its modeling code has no KV
    # cache to hand `shared_prompt_logits`: tests/test_lean_policy.py)
    monkeypatch.setattr(lean_policy, "why_not", lambda *args: "transformers' model asked for")
    hf_learner = _learner(tiny_model)
    hf_learner.logits_fn = lp.shared_prompt_logits
    a = assert_same_steps(lean_learner, hf_learner)
    assert np.isfinite(a["actor/grad_norm"])

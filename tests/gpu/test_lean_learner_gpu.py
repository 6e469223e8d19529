"""GPU-only check of the learner's lean training forward (run with `pytest -m gpu tests/gpu`).

On CUDA the shared arithmetic (`asyncrl/llama.py`) repeats K/V heads and SDPA picks CUDA
kernels (with gradients): the logits and gradients of each group's prompt once must still be
transformers' own, Qwen2 (GQA) and Llama, fp32 and bf16. Not yet run on a GPU: written in a
session without one; the CPU twin is `tests/test_lean_learner.py`.
"""

from __future__ import annotations

import pytest
import torch
from test_lean_learner import _grads, _model
from test_shared_prompt import _tensors

from asyncrl.learner import lean
from asyncrl.learner import logprobs as lp

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_training_forward_on_cuda_equals_transformers(arch, dtype):
    model = _model(arch, dtype).to("cuda")
    data = {k: v.to("cuda") for k, v in _tensors().items()}
    real = data["response_mask"].bool()
    fn = lean.lean_shared_logits_for(model)
    assert fn is not None and fn.args[0].native_gqa is False  # CUDA: repeated K/V heads
    got, got_grads = _grads(model, fn, data)
    want, want_grads = _grads(model, lp.shared_prompt_logits, data)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    assert got.is_cuda
    torch.testing.assert_close(got[real], want[real], **tol)
    grad_tol = (
        {"atol": 1e-4, "rtol": 1e-3} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.1}
    )
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **grad_tol)

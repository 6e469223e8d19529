"""GPU-only check of the hf engine's lean decoder forward (run with `pytest -m gpu tests/gpu`).

On CUDA the lean forward repeats K/V heads instead of SDPA's `enable_gqa` (slow there with a
mask), and SDPA picks CUDA kernels: prefill with left padding and decode with rows retiring
and joining must still give transformers' logits and KV, Qwen2 (GQA) and Llama, fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_qwen2
from test_decoder import _lanes, _llama, _real_kv, _run

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_forward_on_cuda_equals_transformers(arch, dtype):
    model = (random_qwen2(init_std=0.2) if arch == "qwen2" else _llama()).to("cuda", dtype)
    lean, reference = _lanes(model)
    assert lean._lean.ops.native_gqa is False  # CUDA takes the repeated-K/V path
    got, got_batch = _run(lean)
    want, want_batch = _run(reference)
    # fp32 CUDA kernels (SDPA's choice differs between the two calls) agree to ~1e-5
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    for a, b in zip(got, want, strict=True):
        assert a.is_cuda
        torch.testing.assert_close(a, b, **tol)
    assert torch.equal(got_batch.mask, want_batch.mask)
    for a, b in zip(_real_kv(got_batch), _real_kv(want_batch), strict=True):
        torch.testing.assert_close(a, b, **tol)

"""GPU-only check of the chunked LM-head scoring (`asyncrl.learner.chunked`; run with
`pytest -m gpu tests/gpu`): with a bf16 head on CUDA its gradient matmuls run in bf16 (the
tensor cores) summed in fp32, and the values and gradients still equal the plain whole-logits
path's within bf16 tolerance (the CPU twin: `tests/test_chunked_logprobs.py`, fp32/fp64)."""

from __future__ import annotations

import pytest
import torch
from test_chunked_logprobs import _grads, _plain

from asyncrl.learner import chunked

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
@pytest.mark.parametrize("chunk", [None, 97])
def test_bf16_head_on_cuda_equals_the_plain_path(chunk):
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = {"generator": g, "device": "cuda"}
    hidden = (torch.randn(2, 600, 256, **kw) / 4).bfloat16().requires_grad_()
    weight = (torch.randn(32_000, 256, **kw) / 16).bfloat16().requires_grad_()
    targets = torch.randint(0, 32_000, (2, 600), **kw)
    g_lp, g_ent = torch.randn(2, 600, **kw), torch.randn(2, 600, **kw)
    proj = chunked.Projection(hidden, weight)
    assert chunked.tensor_cores(weight)
    got = chunked.token_logprobs(proj, targets, 0.7, True, chunk=chunk)
    want = _plain(hidden, weight, None, targets, 0.7)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    for a, b in zip(_grads(got, (hidden, weight), g_lp, g_ent),
                    _grads(want, (hidden, weight), g_lp, g_ent), strict=True):  # fmt: skip
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=5e-2)

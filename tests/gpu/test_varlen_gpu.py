"""GPU-only checks of the varlen attention on packed rows (`asyncrl.learner.varlen`; run with
`pytest -m gpu tests/gpu`): in bf16 on CUDA it takes torch's flash varlen kernel, whose values
and gradients must equal the per-sequence SDPA path (the CPU's, held to a dense block mask by
`tests/test_varlen.py`) and whose packed logprobs must equal the padded batch's."""

from __future__ import annotations

import pytest
import torch
from test_packing import TEMPERATURE, _data, _groups
from test_varlen import _model

from asyncrl.learner import logprobs as lp
from asyncrl.learner import varlen

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _qkv(heads: int, kv_heads: int, total: int, dim: int = 64) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1, heads, total, dim), (1, kv_heads, total, dim), (1, kv_heads, total, dim)]
    return [torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for s in shapes]  # fmt: skip


@needs_gpu
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (12, 2)])
def test_flash_varlen_equals_per_sequence_attention_in_bf16(heads, kv_heads):
    if varlen._kernel()[0] is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen kernel")
    lengths = [700, 1, 2049, 300, 1046]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    q, k, v = _qkv(heads, kv_heads, sum(lengths))
    assert varlen._flash_ok(q, 0.0)
    got = varlen._flash(q, k, v, cu, max(lengths), None)
    grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    want = varlen.per_sequence(q, k, v, cu, None)
    want_grads = torch.autograd.grad(want.float().square().sum(), (q, k, v))
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


@needs_gpu
def test_packed_logprobs_on_cuda_bf16_equal_the_padded_path(tiny_model):
    padded = _model(tiny_model, torch_dtype=torch.bfloat16).to("cuda")
    packed = _model(tiny_model, torch_dtype=torch.bfloat16).to("cuda")
    data = {k: v.to("cuda") for k, v in _data(_groups(long_row=True)).items()}
    want, _ = lp.token_logprobs(padded, data, TEMPERATURE)
    got, _ = lp.token_logprobs(packed, data, TEMPERATURE, packed=True)
    assert packed.config._attn_implementation == varlen.NAME
    real = data["attention_mask"][:, -want.shape[1] :].bool()
    torch.testing.assert_close(got[real], want[real], atol=0.1, rtol=0.02)

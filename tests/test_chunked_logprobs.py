"""The chunked LM-head scoring (`asyncrl.learner.chunked`) equals the plain whole-logits path:
values and gradients wrt hidden states, head weight and bias, with and without entropy, at
every temperature rule, with chunks that do not divide the token count."""

from __future__ import annotations

import pytest
import torch

from asyncrl.algo.kl import entropy_from_logits
from asyncrl.learner import chunked


def _plain(hidden, weight, bias, targets, temperature):
    """Today's arithmetic: whole logits, fp32, / T, log softmax at the target, entropy."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature > 0:
        logits = logits / temperature
    picked = logits.gather(-1, targets[..., None]).squeeze(-1)
    return picked - logits.logsumexp(-1), entropy_from_logits(logits)


def _inputs(dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 7, 16, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(50, 16, generator=g).to(dtype).requires_grad_()
    b = torch.randn(50, generator=g).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, 50, (3, 7), generator=g)
    return hidden, weight, b, targets


def _grads(out, params, g_lp, g_ent):
    loss = (out[0] * g_lp).sum() + ((out[1] * g_ent).sum() if g_ent is not None else 0)
    return torch.autograd.grad(loss, [p for p in params if p is not None])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("chunk", [1, 4, 21, 64])
def test_values_and_gradients_equal_the_whole_logits_path(temperature, with_entropy, chunk):
    hidden, weight, bias, targets = _inputs()
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    want = _plain(hidden, weight, bias, targets, temperature)
    proj = chunked.Projection(hidden, weight, bias)
    got = chunked.token_logprobs(proj, targets, temperature, with_entropy, chunk=chunk)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    if with_entropy:
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    else:
        assert got[1] is None
    ge = g_ent if with_entropy else None
    params = (hidden, weight, bias)
    for a, b in zip(_grads(got, params, g_lp, ge), _grads(want, params, g_lp, ge), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_entropy_only_gradient_and_no_bias():
    """A loss that reads only the entropy (logprobs' gradient None) and a head without bias."""
    hidden, weight, _, targets = _inputs(bias=False)
    got = chunked.token_logprobs(chunked.Projection(hidden, weight), targets, 1.0, True, chunk=5)
    want = _plain(hidden, weight, None, targets, 1.0)
    a = torch.autograd.grad(got[1].sum(), [hidden, weight])
    b = torch.autograd.grad(want[1].sum(), [hidden, weight])
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_bf16_head_matches_the_plain_path_to_bf16_precision():
    """A bf16 model: logits in bf16 cast to fp32 as the plain path does; gradients of the
    weight summed in fp32 over chunks (the plain path: one bf16 matmul), so within bf16's."""
    hidden, weight, bias, targets = _inputs(torch.bfloat16)
    got = chunked.token_logprobs(chunked.Projection(hidden, weight, bias), targets, 1.0, True, 4)
    want = _plain(hidden, weight, bias, targets, 1.0)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    a = torch.autograd.grad(got[0].sum() + got[1].sum(), [hidden, weight])
    b = torch.autograd.grad(want[0].sum() + want[1].sum(), [hidden, weight])
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype == torch.bfloat16
        torch.testing.assert_close(x.float(), y.float(), atol=0.1, rtol=2e-2)


def test_no_tokens_and_no_grad():
    hidden, weight, bias, _ = _inputs()
    empty = chunked.Projection(hidden[:, :0], weight, bias)
    logp, ent = chunked.token_logprobs(empty, torch.zeros(3, 0, dtype=torch.long), 1.0, True)
    assert logp.shape == ent.shape == (3, 0)
    with torch.no_grad():
        logp, _ = chunked.token_logprobs(chunked.Projection(hidden, weight, bias),
                                         torch.zeros(3, 7, dtype=torch.long), 1.0)  # fmt: skip
    assert not logp.requires_grad and logp.shape == (3, 7)


def test_chunk_tokens_follow_the_byte_budget():
    assert chunked.chunk_tokens(151_936) == (64 << 20) // (4 * 151_936)
    assert chunked.chunk_tokens(10**9) == 1


def test_exact_in_float64():
    """The gradients are the true ones, not an approximation: equal to autograd's to 1e-10 in
    float64, with scaled logits far from 0 (large hidden states, T = 0.7)."""
    hidden, weight, bias, targets = _inputs(torch.float64)
    with torch.no_grad():
        hidden.mul_(3)
    got = chunked.token_logprobs(chunked.Projection(hidden, weight, bias), targets, 0.7, True, 4)
    want = _plain(hidden, weight, bias, targets, 0.7)
    g_lp, g_ent = torch.randn(3, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    params = (hidden, weight, bias)
    for a, b in zip(
        _grads(got, params, g_lp, g_ent), _grads(want, params, g_lp, g_ent), strict=True
    ):
        torch.testing.assert_close(a, b.to(a.dtype), atol=1e-10, rtol=1e-10)


def test_backward_keeps_no_logits():
    """What autograd keeps for backward: the inputs and two floats per token, no [N, V]."""
    hidden, weight, bias, targets = _inputs()
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked.token_logprobs(chunked.Projection(hidden, weight, bias), targets, 0.7, True, 4)
    assert sorted(saved) == sorted([(21, 16), (50, 16), (50,), (21,), (21,), (21,)])

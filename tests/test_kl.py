"""KL estimators (closed forms, clamps, straight-through variants, exact KL) and entropy."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algo.kl import (
    KL_TYPES,
    entropy_bonus,
    entropy_from_logits,
    full_kl,
    kl_in_reward,
    kl_loss,
    kl_penalty,
)

D = torch.float64
LOGP = torch.tensor([[-1.0, -2.0]], dtype=D)
REF = torch.tensor([[-1.5, -1.0]], dtype=D)
LR = [0.5, -1.0]  # logp - ref


def k3(lr: float) -> float:
    return math.exp(-lr) + lr - 1


@pytest.mark.parametrize(
    ("kl_type", "expected"),
    [
        ("kl", LR),
        ("k1", LR),
        ("abs", [0.5, 1.0]),
        ("mse", [0.125, 0.5]),
        ("k2", [0.125, 0.5]),
        ("low_var_kl", [k3(0.5), k3(-1.0)]),
        ("k3", [k3(0.5), k3(-1.0)]),
    ],
)
def test_closed_forms(kl_type, expected):
    out = kl_penalty(LOGP, REF, kl_type)
    assert out.shape == LOGP.shape
    assert out[0].tolist() == pytest.approx(expected)


def test_k3_values_and_clamp():
    assert k3(0.5) == pytest.approx(0.1065306597)
    assert k3(-1.0) == pytest.approx(math.e - 2)
    # ref - logp = 30 is clamped to 20 before exp, and the result to 10 (verl).
    out = kl_penalty(torch.tensor([-31.0], dtype=D), torch.tensor([-1.0], dtype=D), "k3")
    assert out.item() == 10.0
    big = kl_penalty(torch.tensor([-1.0], dtype=D), torch.tensor([-1e4], dtype=D), "k3")
    assert torch.isfinite(big).all() and big.item() == 10.0  # exp(-20) + 20 - 1 -> 10
    assert (kl_penalty(torch.randn(50, dtype=D), torch.randn(50, dtype=D), "k3") >= 0).all()


@pytest.mark.parametrize("base", ["k1", "kl", "abs", "k3", "low_var_kl"])
def test_straight_through_plus_variants(base):
    lp = LOGP.clone().requires_grad_()
    out = kl_penalty(lp, REF, base + "+")
    assert torch.allclose(out, kl_penalty(LOGP, REF, base))
    out.sum().backward()
    assert torch.allclose(lp.grad, LOGP - REF)  # gradient of k2 = lr


def test_unknown_type_errors():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LOGP, REF, "k4")
    with pytest.raises(ValueError, match="'\\+'"):
        kl_penalty(LOGP, REF, "full+")


def _kl_reference(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits, -1)
    return (p * (torch.log(p) - torch.log_softmax(ref_logits, -1))).sum(-1)


def test_full_kl_logits_and_logprobs_agree():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g, dtype=D)
    ref = torch.randn(2, 3, 7, generator=g, dtype=D)
    out = kl_penalty(logits, ref, "full")
    assert out.shape == (2, 3)
    assert torch.allclose(out, _kl_reference(logits, ref))
    as_logp = kl_penalty(torch.log_softmax(logits, -1), torch.log_softmax(ref, -1), "full")
    assert torch.allclose(out, as_logp)
    assert torch.allclose(full_kl(logits, logits), torch.zeros(2, 3, dtype=D), atol=1e-12)
    assert (out > 0).all()


def test_full_kl_zero_probability_tokens_and_gradient():
    logits = torch.tensor([[0.0, 1.0, float("-inf")]], dtype=D, requires_grad=True)
    ref = torch.tensor([[0.5, 0.0, float("-inf")]], dtype=D)
    out = full_kl(logits, ref)
    out.sum().backward()
    expected = _kl_reference(torch.tensor([[0.0, 1.0]], dtype=D), torch.tensor([[0.5, 0.0]]))
    assert out.item() == pytest.approx(expected.item())
    assert torch.isfinite(logits.grad).all()
    with pytest.raises(ValueError, match="full"):
        full_kl(torch.zeros(2, 3), torch.zeros(2, 4))
    x = torch.randn(2, 5, dtype=D, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: full_kl(z, torch.zeros(2, 5, dtype=D)), (x,))


def test_full_kl_bf16_reduces_in_fp32():
    logits = torch.randn(4, 16).to(torch.bfloat16)
    out = full_kl(logits, torch.zeros_like(logits))
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), _kl_reference(logits.float(), torch.zeros(4, 16)), atol=1e-2)


def test_k1_and_k3_are_unbiased_monte_carlo():
    g = torch.Generator().manual_seed(0)
    logits, ref = torch.tensor([1.0, 0.0, -1.0], dtype=D), torch.tensor([0.0, 0.5, 0.0], dtype=D)
    logp, ref_logp = torch.log_softmax(logits, -1), torch.log_softmax(ref, -1)
    idx = torch.multinomial(logp.exp(), 200_000, replacement=True, generator=g)
    exact = full_kl(logits, ref).item()
    for kl_type in ("k1", "k3"):
        est = kl_penalty(logp[idx], ref_logp[idx], kl_type).mean().item()
        assert est == pytest.approx(exact, rel=0.03)


def test_kl_loss_and_kl_in_reward():
    mask = torch.tensor([[1.0, 0.0]], dtype=D)
    assert kl_loss(LOGP, REF, mask, "k1").item() == pytest.approx(0.5)
    scores = torch.tensor([[0.0, 1.0]], dtype=D)
    out = kl_in_reward(scores, LOGP, REF, mask, kl_coef=0.1, kl_type="kl")
    assert out[0].tolist() == pytest.approx([-0.05, 1.0])
    assert set(KL_TYPES) >= {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"}


def test_entropy_from_logits():
    assert entropy_from_logits(torch.zeros(2, 4, dtype=D)).tolist() == pytest.approx(
        [math.log(4)] * 2
    )
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=D) * 3
    p = torch.softmax(logits, -1)
    assert torch.allclose(entropy_from_logits(logits), -(p * p.log()).sum(-1))
    huge = torch.tensor([[1000.0, 0.0, -1000.0]])
    assert entropy_from_logits(huge).item() == pytest.approx(0.0, abs=1e-6)
    masked = torch.tensor([[0.0, 0.0, float("-inf")]], requires_grad=True)
    h = entropy_from_logits(masked)
    h.sum().backward()
    assert h.item() == pytest.approx(math.log(2))
    assert torch.isfinite(masked.grad).all()


def test_entropy_bonus():
    ent = torch.tensor([[1.0, 3.0], [2.0, 9.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=D)
    term, mean_h = entropy_bonus(ent, mask, entropy_coeff=0.01)
    assert mean_h == pytest.approx(2.0)
    assert term.item() == pytest.approx(-0.02)
    zero, _ = entropy_bonus(ent, mask, entropy_coeff=0.0)
    assert zero.item() == 0.0

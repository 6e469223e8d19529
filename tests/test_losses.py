"""Policy losses and loss aggregation: hand-computed cases, gradients, gradcheck, IS weights."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algo.agg import agg_loss, masked_mean, masked_var, masked_whiten
from asyncrl.algo.losses import (
    LOSSES_NEEDING_BEHAV,
    POLICY_LOSSES,
    PolicyLossParams,
    get_policy_loss,
    policy_loss_cispo,
    policy_loss_clip_cov,
    policy_loss_decoupled,
    policy_loss_geo_mean,
    policy_loss_gpg,
    policy_loss_gspo,
    policy_loss_kl_cov,
    policy_loss_vanilla,
)

D = torch.float64


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


def call(name, lp, old, adv, mask, mode="token-mean", cfg=None, w=None, behav=None):
    fn = get_policy_loss(name)
    kw = {"behav_log_prob": old if behav is None else behav} if name in LOSSES_NEEDING_BEHAV else {}
    return fn(lp, old, adv, mask, mode, cfg or PolicyLossParams(), w, **kw)


# ------------------------------------------------------------------ aggregation

LOSS_MAT = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
MASK = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),
        ("seq-mean-token-sum", (3 + 4) / 2),
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", (3 / 3 + 4 / 3) / 2),
    ],
)
def test_agg_modes_hand_computed(mode, expected):
    assert agg_loss(t(LOSS_MAT), t(MASK), mode).item() == pytest.approx(expected)


def test_agg_norm_len_and_global_denominators():
    assert agg_loss(t(LOSS_MAT), t(MASK), "seq-mean-token-sum-norm", norm_len=10).item() == (
        pytest.approx((0.3 + 0.4) / 2)
    )
    assert agg_loss(t(LOSS_MAT), t(MASK), "token-mean", num_tokens=7).item() == pytest.approx(1.0)
    assert agg_loss(t(LOSS_MAT), t(MASK), "seq-mean-token-sum", num_seqs=7).item() == (
        pytest.approx(1.0)
    )


def test_agg_empty_row_and_empty_mask_no_nan():
    mask = t([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert agg_loss(t(LOSS_MAT), mask, "seq-mean-token-mean").item() == pytest.approx(0.75)
    for mode in (
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ):
        x = t(LOSS_MAT).requires_grad_()
        loss = agg_loss(x, torch.zeros(2, 3, dtype=D), mode)
        loss.backward()
        assert loss.item() == 0.0
        assert torch.all(x.grad == 0)


def test_agg_masked_nan_does_not_leak():
    x = t([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]]).requires_grad_()
    loss = agg_loss(x, t(MASK), "token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(7 / 3)
    assert torch.isfinite(x.grad).all()


def test_agg_bool_mask_and_bad_mode():
    assert agg_loss(t(LOSS_MAT), t(MASK).bool(), "token-mean").item() == pytest.approx(7 / 3)
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(t(LOSS_MAT), t(MASK), "token-sum")
    with pytest.raises(ValueError, match="shape"):
        agg_loss(t(LOSS_MAT), t([[1.0]]), "token-mean")


def test_masked_stats():
    vals, mask = t([1.0, 2.0, 3.0, 100.0]), t([1.0, 1.0, 1.0, 0.0])
    assert masked_mean(vals, mask).item() == pytest.approx(2.0)
    assert masked_var(vals, mask).item() == pytest.approx(1.0)
    assert masked_var(vals, mask, unbiased=False).item() == pytest.approx(2 / 3)
    assert torch.allclose(masked_whiten(vals, mask)[:3], t([-1.0, 0.0, 1.0]), atol=1e-6)
    one = t([0.0, 1.0, 0.0, 0.0])
    assert masked_var(vals, one).item() == 0.0
    assert torch.isfinite(masked_whiten(vals, one)).all()
    assert torch.isfinite(masked_whiten(vals, torch.zeros(4, dtype=D))).all()
    rows = masked_mean(t([[1.0, 3.0], [5.0, 7.0]]), t([[1.0, 1.0], [0.0, 0.0]]), dim=-1)
    assert rows.tolist() == [2.0, 0.0]


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(-100, 100), min_size=1, max_size=20),
    st.lists(st.booleans(), min_size=20, max_size=20),
)
def test_masked_mean_matches_selection(values, keep):
    vals = t(values)
    mask = torch.tensor(keep[: len(values)], dtype=D)
    sel = [v for v, k in zip(values, keep, strict=False) if k]
    expected = sum(sel) / len(sel) if sel else 0.0
    assert masked_mean(vals, mask).item() == pytest.approx(expected, abs=1e-9)


# ------------------------------------------------------------------ vanilla PPO

# Ratios/advantages chosen to hit every branch (clip_ratio_low 0.2, clip_ratio_high 0.28, c = 3):
#   (0,0) r=1.5 A=+1  upper clip      -> -1.28
#   (0,1) r=0.5 A=+1  unclipped       -> -0.5
#   (0,2) r=1.1 A=-1  unclipped       ->  1.1
#   (1,0) r=0.7 A=-1  lower clip      ->  0.8
#   (1,1) r=4.0 A=-2  dual clip       ->  6.0   (unclipped would be 8)
#   (1,2) r=1.0 A=+2  unclipped       -> -2.0
RATIOS = [[1.5, 0.5, 1.1], [0.7, 4.0, 1.0]]
ADV = [[1.0, 1.0, -1.0], [-1.0, -2.0, 2.0]]
PG = [[-1.28, -0.5, 1.1], [0.8, 6.0, -2.0]]
ASYM = PolicyLossParams(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def ppo_case(ratios=RATIOS):
    old = t([[-1.0, -2.0, -0.5], [-1.5, -3.0, -0.7]])
    lp = (old + torch.log(t(ratios))).requires_grad_()
    return lp, old, t(ADV), torch.ones(2, 3, dtype=D)


def test_vanilla_hand_computed_branches():
    lp, old, adv, mask = ppo_case()
    loss, m = policy_loss_vanilla(lp, old, adv, mask, "token-mean", ASYM)
    assert loss.item() == pytest.approx(sum(map(sum, PG)) / 6)
    assert m["clipfrac"] == pytest.approx(2 / 6)
    assert m["clipfrac_lower"] == pytest.approx(1 / 6)
    assert m["ppo_kl"] == pytest.approx(-sum(math.log(r) for row in RATIOS for r in row) / 6)
    loss.backward()
    # Unclipped tokens: d(-A r)/dlogp = -A r; clipped and dual-clipped tokens: 0.
    expected = t([[0.0, -0.5, 1.1], [0.0, 0.0, -2.0]]) / 6
    assert torch.allclose(lp.grad, expected)


def test_vanilla_symmetric_clip_and_no_dual_clip():
    lp, old, adv, mask = ppo_case()
    sym = PolicyLossParams(clip_ratio=0.2, clip_ratio_c=3.0)
    loss, _ = policy_loss_vanilla(lp, old, adv, mask, "token-mean", sym)
    assert loss.item() == pytest.approx((sum(map(sum, PG)) + 1.28 - 1.2) / 6)
    no_dual = PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None)
    loss, m = policy_loss_vanilla(lp, old, adv, mask, "token-mean", no_dual)
    assert loss.item() == pytest.approx((sum(map(sum, PG)) - 6.0 + 8.0) / 6)
    assert m["clipfrac_lower"] == 0.0


def test_vanilla_mask_and_is_weights():
    lp, old, adv, _ = ppo_case()
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, _ = policy_loss_vanilla(lp, old, adv, mask, "token-mean", ASYM)
    assert loss.item() == pytest.approx((sum(map(sum, PG)) + 2.0) / 5)
    w = t([[2.0, 1.0, 1.0], [1.0, 0.5, 1.0]])
    loss, _ = policy_loss_vanilla(lp, old, adv, torch.ones(2, 3, dtype=D), "token-mean", ASYM, w)
    expected = (2 * -1.28 - 0.5 + 1.1 + 0.8 + 0.5 * 6.0 - 2.0) / 6
    assert loss.item() == pytest.approx(expected)


def test_params_validation_and_fallback():
    assert PolicyLossParams(clip_ratio=0.3).eps_low == 0.3
    assert PolicyLossParams(clip_ratio=0.3, clip_ratio_high=0.4).eps_high == 0.4
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossParams(clip_ratio_c=0.9)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        PolicyLossParams(clip_ratio_low=-0.1)


# ------------------------------------------------------------------ GSPO


def gspo_case():
    old = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    lr = t([[0.1, 0.2, 0.3], [-0.3, 0.0, 5.0]])  # row 1 token 2 is masked
    lp = (old + lr).requires_grad_()
    adv = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return lp, old, adv, mask


def test_gspo_hand_computed():
    lp, old, adv, mask = gspo_case()
    cfg = PolicyLossParams(clip_ratio=0.2)
    s0, s1 = math.exp(0.2), math.exp(-0.15)  # s0 = 1.221 clipped to 1.2; s1 = 0.861 not
    loss, m = policy_loss_gspo(lp, old, adv, mask, "seq-mean-token-mean", cfg)
    assert s0 > 1.2 and 0.8 < s1 < 1.2
    assert loss.item() == pytest.approx((-1.2 + s1) / 2)
    assert m["clipfrac"] == pytest.approx(3 / 5)
    loss.backward()
    # Token-level gradient is s_i * grad log pi_t (times -A and the agg weight 1/(B*|y_i|)).
    assert torch.allclose(lp.grad, t([[0.0, 0.0, 0.0], [s1 / 4, s1 / 4, 0.0]]))
    tok, _ = policy_loss_gspo(lp, old, adv, mask, "token-mean", cfg)
    assert tok.item() == pytest.approx((3 * -1.2 + 2 * s1) / 5)


def test_gspo_default_agg_is_seq_mean_token_mean():
    lp, old, adv, mask = gspo_case()
    default, _ = policy_loss_gspo(lp, old, adv, mask)
    explicit, _ = policy_loss_gspo(lp, old, adv, mask, "seq-mean-token-mean")
    assert default.item() == explicit.item()


# ------------------------------------------------------------------ GPG, CISPO


def test_gpg_hand_computed():
    lp = t([[-1.0, -2.0, -0.5], [-0.1, -0.2, -0.3]]).requires_grad_()
    adv = t([[1.0, 2.0, -1.0], [0.5, 0.0, 3.0]])
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, m = policy_loss_gpg(lp, lp.detach(), adv, mask)
    assert loss.item() == pytest.approx((1 + 4 - 0.5 + 0.05 + 0.0) / 5)
    assert m["clipfrac"] == 0.0 and m["ppo_kl"] == 0.0
    loss.backward()
    assert torch.allclose(lp.grad, -adv * mask / 5)


def test_cispo_hand_computed_and_stop_gradient():
    lp, old, adv, mask = ppo_case()
    loss, m = policy_loss_cispo(lp, old, adv, mask, "token-mean", ASYM)
    clipped = t([[1.28, 0.8, 1.1], [0.8, 1.28, 1.0]])
    assert loss.item() == pytest.approx((-clipped * adv * lp.detach()).sum().item() / 6)
    assert m["clipfrac"] == pytest.approx(4 / 6)
    loss.backward()
    # The clipped ratio is a constant weight: gradient is -sg(clip r) * A, for clipped tokens too.
    assert torch.allclose(lp.grad, -clipped * adv / 6)


# ------------------------------------------------------------------ GMPO (geo_mean)


def test_geo_mean_hand_computed():
    old = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    lr = t([[0.1, 0.3, -0.1], [-0.5, 0.1, 0.0]])
    lp = (old + lr).requires_grad_()
    adv = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.ones(2, 3, dtype=D)
    loss, m = policy_loss_geo_mean(lp, old, adv, mask, "token-mean", PolicyLossParams())
    # A>0 caps log-ratios from above at +0.2; A<0 caps them from below at -0.2.
    r0, r1 = math.exp((0.1 + 0.2 - 0.1) / 3), math.exp((-0.2 + 0.1 + 0.0) / 3)
    assert loss.item() == pytest.approx((-r0 + r1) / 2)
    assert m["clipfrac"] == pytest.approx(1 / 6)
    assert m["clipfrac_lower"] == pytest.approx(1 / 6)
    loss.backward()
    expected = t([[-r0, 0.0, -r0], [0.0, r1, r1]]) / 3 / 2
    assert torch.allclose(lp.grad, expected)


def test_geo_mean_is_weights_use_sequence_geometric_mean():
    old = t([[-1.0, -1.0]])
    lp = old + t([[0.05, -0.05]])
    adv, mask = t([[1.0, 1.0]]), t([[1.0, 1.0]])
    base, _ = policy_loss_geo_mean(lp, old, adv, mask)
    w = t([[4.0, 1.0]])  # geometric mean 2
    weighted, _ = policy_loss_geo_mean(lp, old, adv, mask, "token-mean", PolicyLossParams(), w)
    assert weighted.item() == pytest.approx(2 * base.item())


# ------------------------------------------------------------------ Clip-Cov / KL-Cov


def cov_case(old_shift=None):
    # mean(A) = 0, mean(logp) = -10/6; cov = (A - 0)(logp + 5/3): 2/3 on row 0, -2/3 on (1,0),
    # (1,1) and 10/3 on (1,2): the only token in (clip_cov_lb=1, clip_cov_ub=5) and the top one.
    lp = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -5.0]]).requires_grad_()
    old = lp.detach().clone() if old_shift is None else lp.detach() - t(old_shift)
    adv = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    return lp, old, adv, torch.ones(2, 3, dtype=D)


def test_clip_cov_detaches_selected_token():
    lp, old, adv, mask = cov_case()
    loss, m = policy_loss_clip_cov(lp, old, adv, mask, "token-mean", PolicyLossParams())
    assert loss.item() == pytest.approx((-3 + 2) / 6)
    assert m["clipfrac"] == pytest.approx(1 / 6)
    loss.backward()
    assert torch.allclose(lp.grad, t([[-1.0, -1.0, -1.0], [1.0, 1.0, 0.0]]) / 6)


def test_clip_cov_skips_tokens_already_clipped():
    # (1,2): r = 0.5 with A < 0 is clipped by PPO itself, so clip-cov leaves it alone.
    lp, old, adv, mask = cov_case([[0.0, 0.0, 0.0], [0.0, 0.0, math.log(0.5)]])
    loss, m = policy_loss_clip_cov(lp, old, adv, mask, "token-mean", PolicyLossParams())
    assert m["clipfrac"] == 0.0
    assert loss.item() == pytest.approx((-3 + 2 + 0.8) / 6)


def test_kl_cov_penalises_top_covariance_token():
    lp, old, adv, mask = cov_case([[0.0, 0.0, 0.0], [0.0, 0.0, 0.1]])
    cfg = PolicyLossParams(kl_cov_ratio=0.0002, ppo_kl_coef=0.1)
    loss, m = policy_loss_kl_cov(lp, old, adv, mask, "token-mean", cfg)
    assert loss.item() == pytest.approx((-3 + 2 + math.exp(0.1) + 0.1 * 0.1) / 6)
    assert m["kl_cov_frac"] == pytest.approx(1 / 6)
    assert m["ppo_kl_abs"] == pytest.approx(0.1 / 6)
    loss.backward()
    expected = t([[-1.0, -1.0, -1.0], [1.0, 1.0, math.exp(0.1) + 0.1]]) / 6
    assert torch.allclose(lp.grad, expected)


# ------------------------------------------------------------------ AReaL decoupled


def test_decoupled_hand_computed():
    lp, prox, adv, mask = ppo_case()
    w = t([[1.0, 2.0, 0.5], [1.0, 1.0, 1.0]])
    behav = prox - torch.log(w)
    behav[1, 2] = float("-inf")  # exp(prox - behav) = inf -> weight 0
    loss, m = policy_loss_decoupled(lp, prox, adv, mask, "token-mean", ASYM, behav_log_prob=behav)
    assert loss.item() == pytest.approx((-1.28 - 1.0 + 0.55 + 0.8 + 6.0 + 0.0) / 6)
    assert m["clipfrac"] == pytest.approx(2 / 6) and m["clipfrac_lower"] == pytest.approx(1 / 6)
    assert m["behav_drop_frac"] == pytest.approx(1 / 6)
    loss.backward()
    assert torch.allclose(lp.grad, t([[0.0, -1.0, 0.55], [0.0, 0.0, 0.0]]) / 6)


def test_decoupled_equals_vanilla_when_prox_is_behav_and_cap():
    lp, prox, adv, mask = ppo_case()
    a, _ = policy_loss_decoupled(lp, prox, adv, mask, "token-mean", ASYM, behav_log_prob=prox)
    b, _ = policy_loss_vanilla(lp, prox, adv, mask, "token-mean", ASYM)
    assert a.item() == pytest.approx(b.item())
    w = t([[1.0, 2.0, 0.5], [1.0, 1.0, 1.0]])
    capped = PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28, behav_imp_weight_cap=1.5)
    loss, _ = policy_loss_decoupled(
        lp, prox, adv, mask, "token-mean", capped, behav_log_prob=prox - torch.log(w)
    )
    assert loss.item() == pytest.approx((-1.28 + 0.0 + 0.55 + 0.8 + 6.0 - 2.0) / 6)


def test_decoupled_behav_weight_is_fp32_and_detached():
    lp = torch.zeros(1, 2, dtype=torch.bfloat16, requires_grad=True)
    prox = torch.zeros(1, 2, dtype=torch.bfloat16, requires_grad=True)
    behav = torch.tensor([[-0.001, float("nan")]], dtype=torch.bfloat16)
    loss, m = policy_loss_decoupled(
        lp, prox, torch.ones(1, 2), torch.ones(1, 2), behav_log_prob=behav
    )
    loss.backward()
    assert torch.isfinite(lp.grad.float()).all()
    assert m["behav_drop_frac"] == pytest.approx(0.5)
    assert math.isfinite(loss.item())


# ------------------------------------------------------------------ gradcheck (float64)


def _grad_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(3, 4, generator=g, dtype=D) - 0.5
    lr = (torch.rand(3, 4, generator=g, dtype=D) - 0.5) * 0.2  # |lr| < 0.1: inside clip range
    lr[0, 0], lr[1, 1] = 0.7, -0.6  # far outside: clipped, away from the kink
    seq_adv = t([1.3, -0.7, 2.1])
    adv = seq_adv[:, None].expand(3, 4).clone()  # per-sequence (outcome) advantages
    mask = t([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    return old + lr, old, adv, mask


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("vanilla", "token-mean"),
        ("vanilla", "seq-mean-token-sum"),
        ("vanilla", "seq-mean-token-sum-norm"),
        ("gspo", "seq-mean-token-mean"),
        ("gpg", "seq-mean-token-mean"),
        ("geo_mean", "token-mean"),
        ("clip_cov", "token-mean"),
        ("kl_cov", "token-mean"),
        ("decoupled", "token-mean"),
    ],
)
def test_gradcheck(name, mode):
    lp0, old, adv, mask = _grad_inputs()
    # clip_cov_ratio 1 selects every candidate (no random draw); kl_cov picks its top 1.
    cfg = PolicyLossParams(clip_ratio=0.2, clip_cov_ratio=1.0, clip_cov_lb=0.01, kl_cov_ratio=0.2)
    w = torch.rand(3, 4, generator=torch.Generator().manual_seed(1), dtype=D) + 0.5
    if name == "gspo":  # the token-gradient trick equals the true gradient only for
        w = w[:, :1].expand(3, 4)  # weights (and advantages) constant within a sequence
    behav = old - 0.05

    def f(lp):
        return call(name, lp, old, adv, mask, mode, cfg, w * mask, behav)[0]

    assert torch.autograd.gradcheck(f, (lp0.clone().requires_grad_(),))


def test_gradcheck_cispo_clipped_region():
    # The stop-gradient weight is locally constant only where the ratio is clipped.
    lp0, old, adv, mask = _grad_inputs()
    lp0 = old + torch.where(torch.arange(4) % 2 == 0, 0.5, -0.5).to(D).expand(3, 4)
    f = lambda lp: policy_loss_cispo(lp, old, adv, mask)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, (lp0.clone().requires_grad_(),))


# ------------------------------------------------------------------ registry, IS, edge cases


def test_registry_names_and_error():
    assert set(POLICY_LOSSES) == {
        "vanilla",
        "gspo",
        "gpg",
        "clip_cov",
        "kl_cov",
        "geo_mean",
        "cispo",
        "decoupled",
    }
    with pytest.raises(ValueError, match="valid: cispo, clip_cov"):
        get_policy_loss("ppo")


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_is_weights_scale_the_loss(name):
    lp, old, adv, mask = _grad_inputs()
    torch.manual_seed(0)  # clip_cov draws its tokens at random: same draw for both calls
    base, _ = call(name, lp, old, adv, mask)
    torch.manual_seed(0)
    doubled, _ = call(name, lp, old, adv, mask, w=2.0 * mask)
    assert doubled.item() == pytest.approx(2.0 * base.item(), rel=1e-6)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_empty_mask_gives_zero_not_nan(name):
    lp0, old, adv, _ = _grad_inputs()
    lp = lp0.clone().requires_grad_()
    loss, metrics = call(name, lp, old, adv, torch.zeros(3, 4, dtype=D))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(lp.grad).all()
    assert {"clipfrac", "ppo_kl", "clipfrac_lower"} <= set(metrics)
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())


def test_is_weight_shape_mismatch():
    lp, old, adv, mask = _grad_inputs()
    with pytest.raises(ValueError, match="rollout_is_weights shape"):
        policy_loss_vanilla(lp, old, adv, mask, "token-mean", PolicyLossParams(), t([1.0]))

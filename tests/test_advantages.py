"""Advantage estimators against hand values, the registry, and DAPO helpers."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algo.advantages import (
    ADV_ESTIMATORS,
    batch_outcome_advantages,
    broadcast_to_tokens,
    compute_advantages,
    gae_advantages,
    get_adv_estimator,
    grpo_advantages,
    outcome_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from asyncrl.algo.agg import masked_whiten
from asyncrl.algo.dapo import overlong_penalty
from asyncrl.algo.group_advantages import (
    ESTIMATOR_STAGES,
    AdvantageParams,
    estimator_stage,
    one_group_advantages,
)

D = torch.float64


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


# ------------------------------------------------------------------ GRPO / Dr.GRPO / RLOO


def test_grpo_known_group_stats():
    # mean 0.75, unbiased std 0.5
    adv = grpo_advantages(t([[1.0, 0.0, 1.0, 1.0]]), epsilon=0.0)
    assert adv[0].tolist() == pytest.approx([0.5, -1.5, 0.5, 0.5])
    eps = grpo_advantages(t([[1.0, 0.0, 1.0, 1.0]]), epsilon=1e-6)
    assert eps[0, 1].item() == pytest.approx(-0.75 / (0.5 + 1e-6))


def test_drgrpo_no_std_normalisation():
    adv = grpo_advantages(t([[1.0, 0.0, 1.0, 1.0]]), norm_by_std=False)
    assert adv[0].tolist() == pytest.approx([0.25, -0.75, 0.25, 0.25])


@pytest.mark.parametrize(
    "ids",
    [
        ["u1", "u2", "u1", "u2"],
        np.array(["u1", "u2", "u1", "u2"], dtype=object),
        torch.tensor([7, 3, 7, 3]),
        np.array([7, 3, 7, 3]),
    ],
)
def test_grpo_group_ids_forms(ids):
    adv = grpo_advantages(t([1.0, 2.0, 3.0, 6.0]), ids, epsilon=0.0)
    r = 1 / math.sqrt(2)  # u1: [1, 3] mean 2 std sqrt 2; u2: [2, 6] mean 4 std 2 sqrt 2
    assert adv.tolist() == pytest.approx([-r, -r, r, r])


def test_group_size_int_and_shaped_agree():
    scores = t([1.0, 0.0, 0.5, 2.0, 2.0, 1.0])
    by_int = grpo_advantages(scores, 3)
    by_shape = grpo_advantages(scores.reshape(2, 3)).reshape(-1)
    assert torch.allclose(by_int, by_shape)
    with pytest.raises(ValueError, match="does not divide"):
        grpo_advantages(scores, 4)


def test_singletons_and_identical_groups_no_nan():
    single = grpo_advantages(t([[3.0], [-1.0]]))
    assert single[:, 0].tolist() == pytest.approx([3.0, -1.0], rel=1e-5)  # verl: mean 0, std 1
    same = grpo_advantages(t([[1.0, 1.0, 1.0]]))
    assert same.tolist() == [[0.0, 0.0, 0.0]]
    assert rloo_advantages(t([[2.0]])).item() == 2.0
    mixed = grpo_advantages(t([1.0, 5.0, 2.0]), ["a", "b", "a"])
    assert torch.isfinite(mixed).all()


def test_grouping_errors():
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(t([1.0, 2.0]))
    with pytest.raises(ValueError, match="3 group ids for 2"):
        grpo_advantages(t([1.0, 2.0]), ["a", "b", "c"])
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(t([[1.0, 2.0]]), ["a", "b"])


def test_rloo_leave_one_out_baseline():
    adv = rloo_advantages(t([[1.0, 0.0, 1.0, 1.0]]))
    # r_i - mean of the other three
    assert adv[0].tolist() == pytest.approx([1 / 3, -1.0, 1 / 3, 1 / 3])
    adv = rloo_advantages(t([4.0, 1.0, 2.0]), [0, 1, 0])
    assert adv.tolist() == pytest.approx([2.0, 1.0, -2.0])


def _grpo_loop(scores, ids, eps):
    groups = defaultdict(list)
    for s, g in zip(scores, ids, strict=True):
        groups[g].append(s)
    out = []
    for s, g in zip(scores, ids, strict=True):
        vals = torch.tensor(groups[g], dtype=D)
        mean, std = (vals.mean(), vals.std()) if len(vals) > 1 else (0.0, 1.0)
        out.append((s - float(mean)) / (float(std) + eps))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, 5), st.integers(0, 4)), min_size=1, max_size=24))
def test_grpo_matches_verl_style_loop(pairs):
    scores, ids = [p[0] for p in pairs], [p[1] for p in pairs]
    adv = grpo_advantages(t(scores), ids, epsilon=1e-6)
    assert torch.isfinite(adv).all()
    assert adv.tolist() == pytest.approx(_grpo_loop(scores, ids, 1e-6), rel=1e-6, abs=1e-6)


# ------------------------------------------------------------------ token level


def test_outcome_token_rewards_and_broadcast():
    mask = t([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = outcome_token_rewards(t([2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]]
    assert broadcast_to_tokens(t([2.0, 3.0, 4.0]), mask).tolist() == [
        [2.0, 2.0, 0.0],
        [3.0, 3.0, 3.0],
        [0.0, 0.0, 0.0],
    ]


def test_reinforce_plus_plus_discounted_returns_whitened():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    assert torch.allclose(ret, t([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    # whitening over the five valid returns: mean 0.95, unbiased var 1.8 / 4 = 0.45
    expected = (t([[0.25, 0.5, 1.0], [1.0, 2.0, 0.95]]) - 0.95) / math.sqrt(0.45 + 1e-8)
    assert torch.allclose(adv, expected * mask)


def test_reinforce_plus_plus_baseline():
    rewards = t([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    mask = torch.ones(4, 2, dtype=D)
    adv, ret = reinforce_pp_baseline_advantages(rewards, mask, [0, 0, 0, 0])
    centred = t([0.25, -0.75, 0.25, 0.25])  # group mean 0.75 removed
    var = 2 * (3 * 0.25**2 + 0.75**2) / 7  # unbiased over the 8 tokens
    assert torch.allclose(adv, (centred / math.sqrt(var + 1e-8))[:, None].expand(4, 2))
    assert torch.equal(adv, ret)


def test_outcome_token_rewards_on_an_episode_sit_on_the_last_generated_token():
    # two turns of generated tokens around an observation (mask 0), then right padding
    mask = t([[1, 1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 0, 0, 0]])
    out = outcome_token_rewards(t([0.5, -1.0]), mask)
    assert out.tolist() == [[0.0] * 5 + [0.5, 0.0], [-1.0] + [0.0] * 6]


def _whiten(values: list[float]) -> list[float]:
    """verl's masked_whiten on a flat list of valid values: unbiased variance, eps 1e-8."""
    mean = math.fsum(values) / len(values)
    var = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def _spread(flat: list[float], mask: torch.Tensor) -> torch.Tensor:
    """Valid values (row-major) back into a [B, T] matrix, 0 outside the mask."""
    out = torch.zeros(mask.shape, dtype=D)
    out[mask.bool()] = t(flat)
    return out


BATCH_MASK = [[1, 1, 1], [1, 1, 0], [1, 0, 0]]


@pytest.mark.parametrize(
    ("gamma", "returns"),
    [
        (1.0, [1.0, 1.0, 1.0, 0.0, 0.0, 2.0]),  # every token carries its row's score
        (0.5, [0.25, 0.5, 1.0, 0.0, 0.0, 2.0]),  # gamma^(distance to the scored last token)
    ],
)
def test_reinforce_plus_plus_batch_closed_form(gamma, returns):
    mask = t(BATCH_MASK)
    params = AdvantageParams(gamma=gamma)
    adv = batch_outcome_advantages("reinforce_plus_plus", t([1.0, 0.0, 2.0]), mask, 3, params)
    assert torch.allclose(adv, _spread(_whiten(returns), mask), rtol=1e-12, atol=1e-12)
    _, ret = reinforce_pp_advantages(outcome_token_rewards(t([1.0, 0.0, 2.0]), mask), mask, gamma)
    assert torch.allclose(ret, _spread(returns, mask))


def test_reinforce_plus_plus_carries_the_return_across_observation_tokens():
    # Token 1 is an environment observation: not an action, so no discount step and its reward
    # (5.0, which the outcome placement never puts there) is ignored; returns are 0 off-mask.
    rewards, mask = t([[0.0, 5.0, 1.0, 0.0]]), t([[1, 0, 1, 0]])
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    assert ret.tolist() == [[0.5, 0.0, 1.0, 0.0]]
    assert torch.allclose(adv, _spread(_whiten([0.5, 1.0]), mask))


def test_reinforce_plus_plus_baseline_batch_closed_form():
    # groups: rows 0-2 (scores 1, 0, 2: mean 1), row 3 alone (keeps 3), rows 4-5 where row 5
    # is a failed episode (no valid token): left out, so row 4 is alone and keeps 4, not 4 - 2.
    mask = t([[1, 1], [1, 0], [1, 0], [1, 1], [1, 0], [0, 0]])
    scores, ids = t([1.0, 0.0, 2.0, 3.0, 4.0, 0.0]), [0, 0, 0, 1, 2, 2]
    adv = batch_outcome_advantages("reinforce_plus_plus_baseline", scores, mask, ids)
    centred_per_token = [0.0, 0.0, -1.0, 1.0, 3.0, 3.0, 4.0]
    assert torch.allclose(adv, _spread(_whiten(centred_per_token), mask), atol=1e-12)
    assert (adv[5] == 0).all()


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("seed", range(5))
def test_batch_whitening_invariants(name, gamma, seed):
    """Over the valid tokens of the batch: mean 0 and unbiased std 1 (up to the 1e-8 epsilon);
    exactly 0 outside the mask, however ragged the rows and masked the observations."""
    g = torch.Generator().manual_seed(seed)
    batch, width = 12, 9
    mask = (torch.rand(batch, width, generator=g) < 0.8).to(D)
    mask[0] = 0.0  # a failed episode
    scores = torch.randint(0, 3, (batch,), generator=g).to(D) + torch.rand(batch, generator=g)
    ids = torch.arange(batch) // 4
    params = AdvantageParams(gamma=gamma)
    adv = batch_outcome_advantages(name, scores, mask, ids, params)
    valid = adv[mask.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert valid.std().item() == pytest.approx(1.0, rel=1e-6)
    assert (adv[mask == 0] == 0).all()


def test_estimator_stages_and_gae_without_a_critic():
    assert set(ESTIMATOR_STAGES) == set(ADV_ESTIMATORS)
    assert [estimator_stage(n) for n in ("grpo", "drgrpo", "rloo")] == ["rollout"] * 3
    assert estimator_stage("reinforce_plus_plus_baseline") == "batch"
    assert estimator_stage("gae") == "critic"
    with pytest.raises(ValueError, match="valid: drgrpo, gae"):
        estimator_stage("remax")
    mask = torch.ones(2, 3, dtype=D)
    with pytest.raises(ValueError, match="'gae' needs a critic"):
        batch_outcome_advantages("gae", t([1.0, 0.0]), mask, 2)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([("grpo", True), ("grpo", False), ("drgrpo", True), ("rloo", True)]),
    st.lists(st.sampled_from([0.0, 1.0, -0.5, 0.25, 3.0]) | st.floats(-10, 10), max_size=9),
)
def test_one_group_numpy_path_equals_the_torch_estimator(which, rewards):
    """The rollout worker's numpy path (one group) gives what compute_advantages gives, for
    singletons, constant groups (std 0) and Dr.GRPO / RLOO alike."""
    name, norm = which
    params = AdvantageParams(norm_adv_by_std_in_grpo=norm)
    scores = np.array(rewards, dtype=np.float32)
    got = one_group_advantages(name, scores, params)
    assert got.dtype == np.float32 and got.shape == scores.shape
    if not rewards:
        return
    # the float64 estimator, rounded to float32: what the numpy path computes
    tokens = torch.as_tensor(scores, dtype=torch.float64).unsqueeze(1)
    want, _ = compute_advantages(name, tokens, torch.ones_like(tokens), params, [0] * len(scores))
    np.testing.assert_allclose(got, want[:, 0].numpy().astype(np.float32), rtol=1e-6, atol=1e-6)


def test_one_group_closed_form_and_refusal():
    r = np.array([1.0, 0.0, 0.0, 1.0], dtype=np.float32)  # mean 0.5, unbiased std 1/sqrt(3)
    np.testing.assert_allclose(one_group_advantages("grpo", r), (r - 0.5) * math.sqrt(3), 1e-5)
    np.testing.assert_allclose(one_group_advantages("rloo", r), (r - 0.5) * 4 / 3, 1e-6)
    assert one_group_advantages("grpo", np.array([2.0]))[0] == pytest.approx(2.0 / (1 + 1e-6))
    with pytest.raises(ValueError, match="'gae' is not computed within one group"):
        one_group_advantages("gae", r)


def test_gae_hand_unrolled():
    rewards, values = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3, dtype=D)
    g, lam = 0.9, 0.8
    d2 = 1.0 - 0.7
    d1 = 0.0 + g * 0.7 - 0.6
    d0 = 0.0 + g * 0.6 - 0.5
    a2 = d2
    a1 = d1 + g * lam * a2
    a0 = d0 + g * lam * a1
    adv, ret = gae_advantages(rewards, values, mask, g, lam, whiten=False)
    assert adv[0].tolist() == pytest.approx([a0, a1, a2])
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.6, a2 + 0.7])
    whitened, _ = gae_advantages(rewards, values, mask, g, lam, whiten=True)
    assert torch.allclose(whitened, masked_whiten(t([[a0, a1, a2]]), mask))


def test_gae_skips_masked_tokens():
    # Token 1 is an environment token (mask 0): the recursion carries V_2 and A_2 across it.
    rewards, values = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]])
    mask = t([[1, 0, 1]])
    adv, ret = gae_advantages(rewards, values, mask, 0.9, 0.8, whiten=False)
    a2 = 0.3
    a0 = (0.9 * 0.7 - 0.5) + 0.9 * 0.8 * a2
    assert adv[0].tolist() == pytest.approx([a0, 0.0, a2])
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, 0.0, 1.0])


def test_gae_gamma_lam_one_is_return_minus_value():
    rewards, values = t([[0.1, 0.2, 0.3, 1.0]]), t([[0.4, 0.3, 0.2, 0.1]])
    adv, ret = gae_advantages(rewards, values, torch.ones(1, 4, dtype=D), 1.0, 1.0, whiten=False)
    rtg = t([[1.6, 1.5, 1.3, 1.0]])
    assert torch.allclose(adv, rtg - values)
    assert torch.allclose(ret, rtg)


# ------------------------------------------------------------------ registry


def test_registry_names_and_errors():
    assert set(ADV_ESTIMATORS) == {
        "grpo",
        "drgrpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "gae",
    }
    with pytest.raises(ValueError, match="valid: drgrpo, gae, grpo"):
        get_adv_estimator("remax")
    rewards, mask = torch.ones(2, 3, dtype=D), torch.ones(2, 3, dtype=D)
    with pytest.raises(ValueError, match="'grpo' needs group_ids"):
        compute_advantages("grpo", rewards, mask)
    with pytest.raises(ValueError, match="critic values"):
        compute_advantages("gae", rewards, mask)


@pytest.mark.parametrize(
    ("name", "seq_adv"),
    [
        ("grpo", [0.5, -1.5, 0.5, 0.5]),
        ("drgrpo", [0.25, -0.75, 0.25, 0.25]),
        ("rloo", [1 / 3, -1.0, 1 / 3, 1 / 3]),
    ],
)
def test_registry_outcome_estimators_broadcast(name, seq_adv):
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    rewards = outcome_token_rewards(t([1.0, 0.0, 1.0, 1.0]), mask)
    params = AdvantageParams(epsilon=0.0)
    adv, ret = compute_advantages(name, rewards, mask, params, group_ids=["p"] * 4)
    assert torch.allclose(adv, t(seq_adv)[:, None] * mask)
    assert torch.equal(adv, ret)
    no_std = AdvantageParams(epsilon=0.0, norm_adv_by_std_in_grpo=False)
    if name == "grpo":
        adv2, _ = compute_advantages(name, rewards, mask, no_std, group_ids=4)
        assert torch.allclose(adv2, t([0.25, -0.75, 0.25, 0.25])[:, None] * mask)


def test_registry_token_level_estimators():
    rewards, mask = t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]), t([[1, 1, 1], [1, 1, 0]])
    params = AdvantageParams(gamma=0.5, lam=0.7)
    a, r = compute_advantages("reinforce_plus_plus", rewards, mask, params)
    b, s = reinforce_pp_advantages(rewards, mask, 0.5)
    assert torch.equal(a, b) and torch.equal(r, s)
    values = t([[0.1, 0.2, 0.3], [0.3, 0.2, 0.1]])
    a, r = compute_advantages("gae", rewards, mask, params, values=values)
    b, s = gae_advantages(rewards, values, mask, 0.5, 0.7)
    assert torch.equal(a, b) and torch.equal(r, s)
    a, _ = compute_advantages("reinforce_plus_plus_baseline", rewards, mask, params, group_ids=2)
    assert torch.isfinite(a).all() and (a[mask == 0] == 0).all()


# ------------------------------------------------------------------ DAPO


def test_overlong_penalty():
    lengths = [10, 16, 17, 18, 20, 25]
    out = overlong_penalty(lengths, max_len=20, buffer_len=4, penalty_factor=1.0)
    assert out.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    half = overlong_penalty(torch.tensor(lengths), 20, 4, penalty_factor=0.5)
    assert half.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 20, 0)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 20, 21)

"""Advantage estimators (pure torch), keyed by verl's ``algorithm.adv_estimator`` names.

Outcome estimators work on one score per sequence. Groups (the n responses to one prompt) are
given either by ``group_ids`` (one id per sequence: ints, strings, any hashable; or an int n
meaning consecutive groups of n) or, with ``group_ids=None``, by the shape ``[n_groups, n]`` of
the scores. A group of one never yields NaN: as verl, its baseline is 0 (and its std 1), so the
advantage is the raw score.

Token-level estimators (REINFORCE++, GAE) take [B, T] token rewards and the response mask.
Every registered estimator has the signature
``fn(token_level_rewards, response_mask, params, group_ids=None, values=None)
-> (advantages [B, T], returns [B, T])``.

Where each estimator runs in the loop (`group_advantages.ESTIMATOR_STAGES`): rollout-stage ones
(grpo, drgrpo, rloo) within one group, in the rollout worker (`group_advantages`, numpy: the
workers do not import torch); batch-stage ones over the trained batch, in the learner; gae with
the critic's values (`batch_token_advantages`), without which it raises.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from functools import partial

import numpy as np
import torch

from asyncrl.algo.agg import masked_whiten
from asyncrl.algo.group_advantages import AdvantageParams, estimator_stage

GroupIds = torch.Tensor | np.ndarray | Sequence[Hashable] | int


# ---------------------------------------------------------------- grouping


def _group_inverse(group_ids: GroupIds, batch: int, device: torch.device) -> torch.Tensor:
    """Map each sequence to a dense group index in [0, n_groups)."""
    if isinstance(group_ids, int) and not isinstance(group_ids, bool):
        if group_ids <= 0 or batch % group_ids:
            raise ValueError(f"group size {group_ids} does not divide batch size {batch}")
        return torch.arange(batch, device=device) // group_ids
    if isinstance(group_ids, torch.Tensor) and not torch.is_floating_point(group_ids):
        ids = group_ids.to(device).reshape(-1)
    elif isinstance(group_ids, np.ndarray) and group_ids.dtype.kind in "iub":
        ids = torch.as_tensor(group_ids, device=device).reshape(-1)
    else:
        ids = None
    if ids is not None:
        if ids.numel() != batch:
            raise ValueError(f"{ids.numel()} group ids for {batch} sequences")
        return torch.unique(ids, return_inverse=True)[1]
    if isinstance(group_ids, torch.Tensor | np.ndarray):  # float or object ids (uid strings)
        ids_list = group_ids.reshape(-1).tolist()
    else:
        ids_list = list(group_ids)
    if len(ids_list) != batch:
        raise ValueError(f"{len(ids_list)} group ids for {batch} sequences")
    dense: dict[Hashable, int] = {}
    inverse = [dense.setdefault(g, len(dense)) for g in ids_list]
    return torch.tensor(inverse, dtype=torch.long, device=device)


def _flatten(scores: torch.Tensor, group_ids: GroupIds | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat [B] scores and their group index; the caller reshapes back to ``scores.shape``."""
    if group_ids is None:
        if scores.dim() != 2:
            raise ValueError(
                f"scores of shape {tuple(scores.shape)} need group_ids, or shape [n_groups, n]"
            )
        n_groups, n = scores.shape
        inverse = torch.arange(n_groups, device=scores.device).repeat_interleave(n)
        return scores.reshape(-1), inverse
    if scores.dim() != 1:
        raise ValueError(f"scores with group_ids must be 1-D, got shape {tuple(scores.shape)}")
    return scores, _group_inverse(group_ids, scores.shape[0], scores.device)


def group_stats(
    flat: torch.Tensor, inverse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence (count, mean, unbiased std) of its group; singletons get mean 0, std 1."""
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(n_groups, dtype=flat.dtype, device=flat.device)
    count = zeros.index_add(0, inverse, torch.ones_like(flat))
    mean = zeros.index_add(0, inverse, flat) / count.clamp(min=1)
    sq = zeros.index_add(0, inverse, (flat - mean[inverse]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    single = count <= 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return count[inverse], mean[inverse], std[inverse]


# ---------------------------------------------------------------- outcome (per-sequence)


@torch.no_grad()
def grpo_advantages(
    scores: torch.Tensor,
    group_ids: GroupIds | None = None,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """GRPO: ``(r - mean_g) / (std_g + eps)``; Dr.GRPO (``norm_by_std=False``): ``r - mean_g``."""
    flat, inverse = _flatten(scores, group_ids)
    _, mean, std = group_stats(flat, inverse)
    adv = flat - mean
    if norm_by_std:
        adv = adv / (std + epsilon)
    return adv.reshape(scores.shape)


@torch.no_grad()
def rloo_advantages(scores: torch.Tensor, group_ids: GroupIds | None = None) -> torch.Tensor:
    """RLOO: ``r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_g)``; a singleton keeps ``r``."""
    flat, inverse = _flatten(scores, group_ids)
    count, mean, _ = group_stats(flat, inverse)
    scale = count / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, scale * (flat - mean), flat)
    return adv.reshape(scores.shape)


@torch.no_grad()
def group_mean_baseline(scores: torch.Tensor, group_ids: GroupIds | None = None) -> torch.Tensor:
    """``r - mean_g`` (REINFORCE++-baseline's first step); a singleton keeps ``r``."""
    return grpo_advantages(scores, group_ids, norm_by_std=False)


# ---------------------------------------------------------------- token level


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] token rewards holding each sequence's score on its last valid token, 0 elsewhere.

    verl's placement (its reward managers write the score at ``valid_response_length - 1``):
    on a single-turn row the last valid token is the last response token. On an episode the
    mask is 0 on environment tokens, so the score sits on the last token the policy generated.
    A row with no valid token gets no reward (it has nothing to train).
    """
    mask = response_mask.to(torch.long)
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=-1).values
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    rows = torch.nonzero(last >= 0, as_tuple=True)[0]
    out[rows, last[rows]] = scores[rows]
    return out


def broadcast_to_tokens(seq_values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T], zero outside the response mask."""
    return seq_values.unsqueeze(-1) * response_mask.to(seq_values.dtype)


@torch.no_grad()
def reinforce_pp_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go over the valid tokens, whitened over the batch.

    ``G_t = r_t + gamma G_next`` where ``next`` is the next *valid* token of the row: a masked
    token (an environment observation inside an episode) is not an action, so it takes no
    discount step and its reward is ignored, and the return carries across it unchanged. On a
    right-padded row this is verl's recursion exactly (its reset "after EOS" only ever meets
    padding there); verl would cut the return at an observation token, leaving every earlier
    turn of an episode without the outcome reward. ``returns`` is 0 outside the mask; the
    advantages are the returns whitened over all valid tokens of the batch (mean 0, unbiased
    variance 1 up to `masked_whiten`'s epsilon), 0 outside the mask."""
    valid = response_mask > 0
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running = torch.where(valid[:, t], token_level_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
    mask = valid.to(token_level_rewards.dtype)
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@torch.no_grad()
def reinforce_pp_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: the sequence score (its valid token rewards summed) minus its
    group's mean score, broadcast over the valid tokens and whitened over the batch.

    As verl, a group of one keeps its raw score. Rows with no valid token (a failed episode)
    carry no signal: they are left out of the group means and get advantage 0.
    """
    mask = (response_mask > 0).to(token_level_rewards.dtype)
    scores = (token_level_rewards * mask).sum(dim=-1)
    inverse = _group_inverse(_require(group_ids, "rf++b"), scores.shape[0], scores.device)
    nonempty = mask.sum(dim=-1) > 0
    centred = torch.zeros_like(scores)
    if bool(nonempty.any()):
        centred[nonempty] = group_mean_baseline(scores[nonempty], inverse[nonempty])
    advantages = masked_whiten(broadcast_to_tokens(centred, mask), mask) * mask
    return advantages, advantages


@torch.no_grad()
def gae_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (verl): ``A_t = delta_t + gamma lam A_{t+1}``, ``delta_t = r_t + gamma V_{t+1} - V_t``.

    Masked tokens (e.g. environment observations mid-trajectory) are skipped: the recursion
    carries the next valid token's value and advantage through them. ``returns = A + V`` is taken
    before whitening; both outputs are zero outside the mask.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    next_value = torch.zeros_like(token_level_rewards[:, 0])
    last_gae = torch.zeros_like(next_value)
    advantages = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last_gae = gae_t * mask[:, t] + (1 - mask[:, t]) * last_gae
        advantages[:, t] = last_gae
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages * mask, returns


# ---------------------------------------------------------------- registry


def _require(group_ids: GroupIds | None, name: str) -> GroupIds:
    if group_ids is None:
        raise ValueError(f"advantage estimator {name!r} needs group_ids (one id per sequence)")
    return group_ids


def _est_grpo(rewards, mask, params, group_ids=None, values=None, norm_by_std=None):
    norm = params.norm_adv_by_std_in_grpo if norm_by_std is None else norm_by_std
    scores = rewards.sum(dim=-1)
    adv = grpo_advantages(scores, _require(group_ids, "grpo"), params.epsilon, norm)
    adv = broadcast_to_tokens(adv, mask)
    return adv, adv


def _est_rloo(rewards, mask, params, group_ids=None, values=None):
    adv = rloo_advantages(rewards.sum(dim=-1), _require(group_ids, "rloo"))
    adv = broadcast_to_tokens(adv, mask)
    return adv, adv


def _est_gae(rewards, mask, params, group_ids=None, values=None):
    if values is None:
        raise ValueError("advantage estimator 'gae' needs a critic (value model): no critic values")
    return gae_advantages(rewards, values, mask, params.gamma, params.lam, params.whiten_gae)


AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": _est_grpo,
    "drgrpo": partial(_est_grpo, norm_by_std=False),
    "rloo": _est_rloo,
    "reinforce_plus_plus": lambda r, m, p, g=None, v=None: reinforce_pp_advantages(r, m, p.gamma),
    "reinforce_plus_plus_baseline": lambda r, m, p, g=None, v=None: (
        reinforce_pp_baseline_advantages(r, m, g)
    ),
    "gae": _est_gae,
}


def get_adv_estimator(name: str) -> AdvantageFn:
    estimator_stage(name)  # the one error for an unknown name
    return ADV_ESTIMATORS[name]


def compute_advantages(
    adv_estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    params: AdvantageParams | None = None,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch on ``adv_estimator``; returns [B, T] (advantages, returns)."""
    fn = get_adv_estimator(adv_estimator)
    return fn(token_level_rewards, response_mask, params or AdvantageParams(), group_ids, values)


@torch.no_grad()
def batch_token_advantages(
    adv_estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    params: AdvantageParams | None = None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] (advantages, returns) of a trained batch from its token rewards, through
    `compute_advantages` (whitening over exactly this batch's valid tokens), in float64. A
    ``critic`` estimator (gae) needs the critic's ``values`` [B, T] and raises without them."""
    mask = (response_mask > 0).to(torch.float64)
    rewards = token_level_rewards.to(torch.float64) * mask
    values = values.to(torch.float64) * mask if values is not None else None
    return compute_advantages(adv_estimator, rewards, mask, params, group_ids, values)


@torch.no_grad()
def batch_outcome_advantages(
    adv_estimator: str,
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    params: AdvantageParams | None = None,
    values: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, T] advantages from one outcome score per row (a response's reward, an episode's
    return), placed on each row's last valid token, through `batch_token_advantages`."""
    mask = (response_mask > 0).to(torch.float64)
    rewards = outcome_token_rewards(scores.to(torch.float64), mask)
    advantages, _ = batch_token_advantages(adv_estimator, rewards, mask, group_ids, params, values)
    return advantages

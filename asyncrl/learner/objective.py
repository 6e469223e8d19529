"""What every learner backend computes the same way, whatever runs the model.

The torch learner and the Megatron learner differ in how they get per-token logprobs (a
transformers forward vs. vocab-parallel cross-entropy over TP shards) and in how they step the
optimizer; everything between — the batch-level advantages, rollout IS and rejection, the
policy objective with its entropy and KL terms, the micro-batch share of a mini-batch loss, the
learning-rate schedule — is here, once, so both backends optimise exactly the same objective.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from asyncrl.algo.advantages import batch_token_advantages, outcome_token_rewards
from asyncrl.algo.group_advantages import AdvantageParams, estimator_stage
from asyncrl.algo.importance import (
    RolloutIS,
    compute_rollout_importance_weights,
    normalize_weights_to_batch_mean,
)
from asyncrl.algo.kl import (
    FixedKLController,
    apply_kl_penalty,
    entropy_bonus,
    kl_loss,
    make_kl_controller,
)
from asyncrl.algo.losses import LOSSES_NEEDING_BEHAV, PolicyLossParams
from asyncrl.algo.rejection import rejection_mask
from asyncrl.config.plan import optimizer_steps
from asyncrl.config.schema import ActorConfig, AlgorithmConfig, OptimConfig, TrainingArgs
from asyncrl.learner.lag_metrics import lag_metrics

_LOSS_KEYS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")


def loss_params(actor: ActorConfig) -> PolicyLossParams:
    return PolicyLossParams(
        clip_ratio=actor.clip_ratio,
        clip_ratio_low=actor.clip_ratio_low,
        clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c,
        **{k: getattr(actor.policy_loss, k) for k in _LOSS_KEYS},
    )


def lr_factor(targs: TrainingArgs, optim: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak learning rate at optimizer step `step` (warm-up, then decay).
    `targs` holds the effective values (the config loader folds verl's `actor.optim` keys into
    actor_train.training_args); the horizon is verl's `optim.total_training_steps` when > 0,
    else `total_steps` (the run's optimizer steps)."""
    floor, warmup, kind = optim.min_lr_ratio, targs.warmup_steps, targs.lr_scheduler_type
    horizon = optim.total_training_steps
    total = max(1, horizon if horizon is not None and horizon > 0 else total_steps)

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "linear":
            return floor + (1 - floor) * (1 - progress)
        if kind == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return factor


def make_optimizer(
    params: list[torch.nn.Parameter], targs: TrainingArgs, optim: OptimConfig
) -> torch.optim.Optimizer:
    """The torch optimizer `actor.optim` names over `params` (the trainable ones). The learning
    rate and weight decay come from `targs`, where the config loader has joined verl's
    `actor.optim.lr`/`weight_decay` with ROLL's keys (one rule, `config/verl_actor.py`)."""
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=targs.learning_rate, weight_decay=targs.weight_decay)
    # Fused (one kernel over every tensor) where torch has it: on the embedded model's ~26
    # small tensors the per-tensor loop costs 4x the update itself (1.7 vs 0.4 ms on the CPU).
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(
        params,
        lr=targs.learning_rate,
        weight_decay=targs.weight_decay,
        betas=tuple(optim.betas),
        eps=optim.eps,
        fused=fused or None,
    )


def check_estimator(alg: AlgorithmConfig, has_critic: bool = False) -> None:
    """Refuse, when the learner is built, an estimator the loop cannot compute (gae without a
    critic), rather than train on the zero advantages that collation fills in."""
    if estimator_stage(alg.adv_estimator) == "critic" and not has_critic:
        raise ValueError(
            f"algorithm.adv_estimator: {alg.adv_estimator} needs a critic (value model): set a "
            "critic section (fsdp2_train learner)"
        )


def check_learner_side(alg: AlgorithmConfig, has_critic: bool, world_size: int) -> None:
    """What `config validate` refuses about the critic and KL-in-reward, refused again where a
    learner is built from code: the critic only serves gae; KL-in-reward needs an estimator
    the learner computes. Both run on any `world_size` (the sharded learner gathers the whole
    batch's values and logprobs on every rank)."""
    check_estimator(alg, has_critic)
    if has_critic and estimator_stage(alg.adv_estimator) != "critic":
        raise ValueError(f"critic: set, but algorithm.adv_estimator {alg.adv_estimator} reads "
                         "no values (only gae does)")  # fmt: skip
    if alg.use_kl_in_reward and estimator_stage(alg.adv_estimator) == "rollout":
        raise ValueError(f"algorithm.use_kl_in_reward: {alg.adv_estimator} is computed in the "
                         "rollout workers; use reinforce_plus_plus(_baseline) or gae")  # fmt: skip


def batch_advantages(
    alg: AlgorithmConfig,
    data: dict[str, torch.Tensor],
    token_rewards: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> torch.Tensor:
    """The [B, R] advantages the policy loss uses for the whole collated batch `data` (see
    `advantages_and_returns`)."""
    return advantages_and_returns(alg, data, token_rewards, values)[0]


@torch.no_grad()
def advantages_and_returns(
    alg: AlgorithmConfig,
    data: dict[str, torch.Tensor],
    token_rewards: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, R] (advantages, returns) of the whole collated batch `data`.

    Group estimators (grpo, drgrpo, rloo) came with the groups from the rollout: returned as
    collated (as the returns too). Batch estimators (REINFORCE++ and its baseline variant) and
    gae (with the critic's `values`) are computed here, through `compute_advantages`, from the
    token rewards: `token_rewards` when given (KL-in-reward), else each row's reward (a
    response's score or an episode's return) on its last valid token (verl's placement). Groups
    are given by `group_index`; the caller runs this on the full batch, before sharding rows
    over ranks or mini-batches, so every mini-batch sees the batch-level whitening. The mask is
    the collated loss mask, before rejection sampling narrows it (group advantages are
    computed before it too). Advantages a group carried for a batch estimator are replaced.
    """
    if estimator_stage(alg.adv_estimator) == "rollout":
        return data["advantages"], data["advantages"]
    check_estimator(alg, has_critic=values is not None)
    params = AdvantageParams(
        gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo
    )
    mask = data["response_mask"]
    if token_rewards is None:
        token_rewards = outcome_token_rewards(data["rewards"].to(torch.float64), mask > 0)
    adv, returns = batch_token_advantages(
        alg.adv_estimator, token_rewards, mask, data["group_index"], params, values
    )
    dtype = data["advantages"].dtype
    return adv.to(dtype), returns.to(dtype)


def kl_controller(alg: AlgorithmConfig) -> FixedKLController | None:
    """The KL-in-reward coefficient's controller (`algorithm.kl_ctrl`); None when off."""
    if not alg.use_kl_in_reward:
        return None
    ctrl = alg.kl_ctrl
    return make_kl_controller(ctrl.type, ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)


def kl_reward(
    alg: AlgorithmConfig,
    controller: FixedKLController,
    token_rewards: torch.Tensor,
    old: torch.Tensor,
    ref: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's KL-in-reward: the token rewards minus beta · kl(old, ref) with the controller's
    current beta, then the controller's update from this batch's KL (n = its rows)."""
    beta = controller.value
    rewards, current = apply_kl_penalty(token_rewards, old, ref, mask, beta, alg.kl_penalty)
    controller.update(current, n_steps=int(mask.shape[0]))
    return rewards, {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta}


def advantage_metrics(advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean, max and min of the advantages over the valid tokens (verl's critic/advantages/*);
    0.0 each when no token is valid."""
    valid = advantages[mask > 0].to(torch.float64)
    if valid.numel() == 0:
        return dict.fromkeys(("learner/adv_mean", "learner/adv_max", "learner/adv_min"), 0.0)
    return {
        "learner/adv_mean": float(valid.mean()),
        "learner/adv_max": float(valid.max()),
        "learner/adv_min": float(valid.min()),
    }


def rollout_is_settings(alg: AlgorithmConfig) -> RolloutIS:
    """The rollout IS settings from verl's flat `algorithm.rollout_is*` keys.

    `rollout_is_batch_normalize` is not one of them: it rescales the weights over the mask that
    rejection sampling leaves, so `correct` applies it after both, outside `apply_rollout_is`.
    """
    return RolloutIS(
        apply=alg.rollout_is,
        level=alg.rollout_is_level,
        mode=alg.rollout_is_mode,
        threshold=alg.rollout_is_threshold,
        threshold_lower=alg.rollout_is_threshold_lower,
        veto_threshold=alg.rollout_is_veto_threshold,
    )


def prox_from_training_forward(
    alg: AlgorithmConfig,
    actor: ActorConfig,
    rows: int,
    stochastic_forward: bool,
    step_size: int | None,
) -> bool:
    """Whether a step of `rows` rows may take its proximal logprobs from the training forward
    (detached) instead of a separate no-grad pass (AReaL's `prox_logp_method`): decoupled
    correction; one optimizer step over the batch (ppo_epochs 1, one mini-batch of the plan's
    `step_size`, `asyncrl.config.plan`), so every
    micro-batch's forward runs the weights that are the proximal policy; a deterministic
    forward (no dropout); and nothing that reads the whole batch's proximal logprobs before the
    first micro-batch's loss: KL-in-reward (the advantages), rejection sampling and batch
    normalisation of the IS weights (the mask and weights of every row); nor with routing
    replay r2, which replays the routes that separate pass records. Rollout IS weights are per
    row, so each micro-batch computes its own; the metrics come from the whole batch."""
    return (
        alg.correction_mode == "decoupled"
        and actor.router_replay != "r2"
        and optimizer_steps(rows, step_size, actor.ppo_epochs) == 1
        and not stochastic_forward
        and not alg.use_kl_in_reward
        and not alg.rollout_rs
        and not alg.rollout_is_batch_normalize
    )


def correct(
    alg: AlgorithmConfig,
    rollout_is: RolloutIS,
    loss_mode: str,
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    lags: torch.Tensor | None = None,
    all_ranks: bool = False,
    metrics: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Rollout IS weights, the rejection-filtered loss mask and the mismatch metrics.

    `old` is the proximal policy (recomputed, or the rollout logprobs in bypass mode). The
    decoupled loss applies exp(prox - behav) itself, so it gets no separate weights.
    `rollout_is` is `rollout_is_settings(alg)`, built once by the learner, not per batch.
    `lags` ([B], `sequence_lags`): adds the ESS and the k3 KL by staleness (`lag_metrics`) of
    the weights and log-probs over the rows rejection sampling keeps, whether or not the loss applies them (metrics-only
    IS, a loss that reweighs itself); batch normalisation, one scale, leaves an ESS unchanged.
    `all_ranks`: see `lag_metrics` (a collective: every rank must pass lags at that call).
    `metrics` False: no IS metrics (the same weights and mask), for a micro-batch whose batch
    reports them from its own call.
    """
    weights, out = compute_rollout_importance_weights(old, rollout, mask, rollout_is, metrics)
    if alg.rollout_rs:
        criteria = [(c.name, c.lower, c.upper) for c in alg.rollout_rs]
        mask, rs_metrics = rejection_mask(old, rollout, mask, criteria)
        out.update(rs_metrics if metrics else {})
    if weights is not None and lags is not None:
        out.update(lag_metrics(weights, mask, lags, rollout_is.level, all_ranks, (old, rollout)))
    if not rollout_is.apply:  # metrics only (verl's `rollout_is: false`)
        weights = None
    if weights is not None and alg.rollout_is_batch_normalize:
        weights = normalize_weights_to_batch_mean(weights, mask, alg.rollout_is_level)
    if loss_mode in LOSSES_NEEDING_BEHAV:
        weights = None
    return weights, mask, out


def objective(
    actor: ActorConfig,
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]],
    params: PolicyLossParams,
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    batch: dict[str, torch.Tensor | None],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss + entropy bonus + KL loss of one micro-batch (not yet scaled by its share).

    `batch` holds the micro-batch rows of: old, advantages, mask, weights (or None),
    rollout_logprobs and ref (or None).
    """
    mask = batch["mask"]
    extra = {}
    if actor.policy_loss.loss_mode in LOSSES_NEEDING_BEHAV:
        extra["behav_log_prob"] = batch["rollout_logprobs"]
    loss, raw = loss_fn(
        logp, batch["old"], batch["advantages"], mask, actor.loss_agg_mode, params,
        batch["weights"], **extra,
    )  # fmt: skip
    metrics = {f"actor/{k}": v for k, v in raw.items()}
    metrics["actor/pg_loss"] = float(loss.detach())
    if entropy is not None:
        # Always reported (a collapsing policy shows here first); it enters the loss only with a
        # non-zero coefficient, so a backend may pass a detached entropy when the coefficient is 0.
        bonus, mean_entropy = entropy_bonus(entropy, mask, actor.entropy_coeff, actor.loss_agg_mode)
        if actor.entropy_coeff != 0:
            loss = loss + bonus
        metrics["actor/entropy"] = mean_entropy
    if batch.get("ref") is not None:
        kl = kl_loss(logp, batch["ref"], mask, actor.kl_loss_type, actor.loss_agg_mode)
        loss = loss + actor.kl_loss_coef * kl
        metrics["actor/kl_loss"] = float(kl.detach())
    return loss, metrics


def micro_share(
    loss_agg_mode: str, mask: torch.Tensor, rows: int, totals: dict[str, Any]
) -> torch.Tensor | float:
    """This micro-batch's weight in its mini-batch loss: token-mean weighs micro-batches by
    their share of tokens, the sequence means by their share of sequences."""
    if loss_agg_mode == "token-mean":
        return mask.sum() / totals["tokens"]
    return rows / totals["seqs"]

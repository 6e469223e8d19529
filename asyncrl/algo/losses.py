"""Policy-gradient losses (pure torch), one function per ``policy_loss.loss_mode``.

Common signature (argument order differs from verl, which puts ``old_log_prob`` first)::

    fn(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode, cfg,
       rollout_is_weights=None) -> (loss, metrics)

All tensors are [B, T]. ``log_prob`` carries the gradient; ``old_log_prob`` is the policy the
ratio is taken against (recomputed by the learner, or the rollout's own log-probs in bypass mode).
``rollout_is_weights`` (detached, already zero on masked tokens) multiply the per-token losses
before aggregation, exactly as verl: ``pg_losses *= w``. ``metrics`` always holds ``clipfrac``,
``ppo_kl`` and ``clipfrac_lower`` as Python floats, plus loss-specific extras.

``decoupled`` (AReaL) also needs the behaviour policy: it takes a keyword-only ``behav_log_prob``
and treats ``old_log_prob`` as the proximal policy; see ``LOSSES_NEEDING_BEHAV``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncrl.algo.agg import agg_loss, masked_mean

_LOG_RATIO_CLAMP = 20.0  # verl: exp() of a log-ratio is taken after clamping to ±20


@dataclass(frozen=True)
class PolicyLossParams:
    """Algorithm-side loss knobs (verl actor keys); the config module maps onto this."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None  # falls back to clip_ratio
    clip_ratio_high: float | None = None  # falls back to clip_ratio
    clip_ratio_c: float | None = 3.0  # dual clip on A < 0; None disables it
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    behav_imp_weight_cap: float | None = None  # decoupled: drop tokens whose behav weight > cap

    def __post_init__(self) -> None:
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1.0 (dual clip), got {self.clip_ratio_c}")
        for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.clip_cov_ratio <= 0 or self.kl_cov_ratio <= 0:
            raise ValueError("clip_cov_ratio and kl_cov_ratio must be > 0")

    @property
    def eps_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def eps_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


LossResult = tuple[torch.Tensor, dict[str, float]]
_DEFAULT = PolicyLossParams()


def _f(x: torch.Tensor | float) -> float:
    return float(x.detach().item()) if isinstance(x, torch.Tensor) else float(x)


def _apply_is(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    if rollout_is_weights is None:
        return pg_losses
    if rollout_is_weights.shape != pg_losses.shape:
        raise ValueError(
            f"rollout_is_weights shape {tuple(rollout_is_weights.shape)} "
            f"!= loss shape {tuple(pg_losses.shape)}"
        )
    return pg_losses * rollout_is_weights.detach()


def _clipped_pg(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: PolicyLossParams,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with asymmetric clip and dual clip; returns per-token losses."""
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).to(ratio.dtype), mask)
    if cfg.clip_ratio_c is None:
        return clip_pg_losses1, {"clipfrac": _f(clipfrac), "clipfrac_lower": 0.0}
    # Dual clip (Ye et al. 2019): for A < 0 the loss is bounded by -A * c, so a huge ratio on a
    # bad action cannot dominate the batch.
    pg_losses3 = -advantages * cfg.clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    lower = torch.gt(clip_pg_losses1, pg_losses3) & (advantages < 0)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    metrics = {
        "clipfrac": _f(clipfrac),
        "clipfrac_lower": _f(masked_mean(lower.to(ratio.dtype), mask)),
    }
    return pg_losses, metrics


def policy_loss_vanilla(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    cfg: PolicyLossParams = _DEFAULT,
    rollout_is_weights: torch.Tensor | None = None,
) -> LossResult:
    """PPO clip: ``max(-A r, -A clip(r, 1-eps_low, 1+eps_high))``, dual clip at ``c`` for A<0."""
    log_ratio = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg_losses, metrics = _clipped_pg(ratio, advantages, response_mask, cfg)
    pg_losses = _apply_is(pg_losses, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    metrics["ppo_kl"] = _f(masked_mean(-log_ratio, response_mask))
    return loss, metrics


def policy_loss_gspo(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    cfg: PolicyLossParams = _DEFAULT,
    rollout_is_weights: torch.Tensor | None = None,
) -> LossResult:
    """GSPO (arXiv 2507.18071): sequence ratio ``s_i = exp(mean_t log r_t)``.

    Token form ``s_i,t = sg[s_i] * pi / sg[pi]`` keeps the value s_i while each token's gradient
    is s_i * grad log pi_t. The paper clips with tiny eps (3e-4 / 4e-4): set clip_ratio_low/high.
    Unlike verl (which forces seq-mean-token-mean), ``loss_agg_mode`` is honoured.
    """
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)
    log_s = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))  # verl's clamp for numerical stability
    pg_losses1 = -advantages * s
    pg_losses2 = -advantages * torch.clamp(s, 1 - cfg.eps_low, 1 + cfg.eps_high)
    pg_losses = _apply_is(torch.maximum(pg_losses1, pg_losses2), rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).to(s.dtype), response_mask)
    metrics = {
        "clipfrac": _f(clipfrac),
        "clipfrac_lower": 0.0,
        "ppo_kl": _f(masked_mean(-log_ratio, response_mask)),
    }
    return loss, metrics


def policy_loss_gpg(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    cfg: PolicyLossParams = _DEFAULT,
    rollout_is_weights: torch.Tensor | None = None,
) -> LossResult:
    """GPG: plain policy gradient ``-log pi * A`` (no ratio, no clip)."""
    pg_losses = _apply_is(-log_prob * advantages, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    ppo_kl = masked_mean(old_log_prob - log_prob, response_mask)
    return loss, {"clipfrac": 0.0, "clipfrac_lower": 0.0, "ppo_kl": _f(ppo_kl)}


def policy_loss_cispo(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    cfg: PolicyLossParams = _DEFAULT,
    rollout_is_weights: torch.Tensor | None = None,
) -> LossResult:
    """CISPO (MiniMax-M1): ``-sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi``.

    Every token keeps a gradient (the clipped IS weight only scales it), unlike PPO where a
    clipped token's gradient vanishes.
    """
    log_ratio = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high).detach()
    pg_losses = _apply_is(-clipped * advantages * log_prob, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    clipfrac = masked_mean(torch.ne(ratio, clipped).to(ratio.dtype), response_mask)
    metrics = {
        "clipfrac": _f(clipfrac),
        "clipfrac_lower": 0.0,
        "ppo_kl": _f(masked_mean(-log_ratio, response_mask)),
    }
    return loss, metrics


def policy_loss_geo_mean(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    cfg: PolicyLossParams = _DEFAULT,
    rollout_is_weights: torch.Tensor | None = None,
) -> LossResult:
    """GMPO (arXiv 2507.20673): geometric mean of token ratios, clipped per token in log space.

    Per token, ``sgn(A) * min(sgn(A) lr, sgn(A) clip(lr, -eps_low, eps_high))``; the sequence
    ratio is ``exp(mean_t ...)`` and the loss ``-mean_t(A) * ratio``, averaged over sequences
    (``loss_agg_mode`` is unused, as in verl). IS weights collapse to a per-sequence geometric
    mean, as verl does.
    """
    log_ratio = log_prob - old_log_prob
    sgn = torch.sign(advantages)
    lr_clamped = torch.clamp(log_ratio, -cfg.eps_low, cfg.eps_high)
    lr_min = sgn * torch.minimum(sgn * log_ratio, sgn * lr_clamped)
    ratio = torch.exp(masked_mean(lr_min, response_mask, dim=-1))
    seq_adv = masked_mean(advantages, response_mask, dim=-1)
    pg_losses = -seq_adv * ratio
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights.detach() + 1e-10)
        pg_losses = pg_losses * torch.exp(masked_mean(log_w, response_mask, dim=-1))
    loss = pg_losses.mean()
    clipped = torch.ne(log_ratio, lr_clamped).to(log_ratio.dtype)
    metrics = {
        "clipfrac": _f(masked_mean(clipped * (advantages > 0), response_mask)),
        "clipfrac_lower": _f(masked_mean(clipped * (advantages < 0), response_mask)),
        "ppo_kl": _f(masked_mean(-log_ratio, response_mask)),
    }
    return loss, metrics


def policy_loss_clip_cov(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    cfg: PolicyLossParams = _DEFAULT,
    rollout_is_weights: torch.Tensor | None = None,
) -> LossResult:
    """Clip-Cov (arXiv 2505.22617): detach the gradient of a few high-covariance tokens.

    Among valid tokens not already clipped by PPO whose centred covariance
    ``(A - mean A)(logp - mean logp)`` lies in (clip_cov_lb, clip_cov_ub), a random
    ``max(1, int(clip_cov_ratio * n_valid))`` are selected (all of them when fewer) and their
    loss is multiplied by 0. No dual clip, no ratio clamp (as verl).
    """
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high)
    valid = response_mask > 0
    with torch.no_grad():
        clip_by_origin = (pg_losses2 > pg_losses1) & valid
        cov = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob - masked_mean(log_prob, response_mask)
        )
        cand = (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub) & valid & ~clip_by_origin
        cand_idx = torch.nonzero(cand.reshape(-1), as_tuple=True)[0]
        clip_num = max(int(cfg.clip_cov_ratio * int(valid.sum().item())), 1)
        if cand_idx.numel() > clip_num:
            cand_idx = cand_idx[torch.randperm(cand_idx.numel(), device=cand_idx.device)]
            cand_idx = cand_idx[:clip_num]
        corr = torch.ones_like(pg_losses1).reshape(-1)
        corr[cand_idx] = 0
        corr = corr.reshape(pg_losses1.shape)
    pg_losses = _apply_is(torch.maximum(pg_losses1, pg_losses2) * corr, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    metrics = {
        "clipfrac": _f(masked_mean((corr == 0).to(ratio.dtype), response_mask)),
        "clipfrac_lower": 0.0,
        "ppo_kl": _f(masked_mean(-log_ratio, response_mask)),
    }
    return loss, metrics


def policy_loss_kl_cov(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    cfg: PolicyLossParams = _DEFAULT,
    rollout_is_weights: torch.Tensor | None = None,
) -> LossResult:
    """KL-Cov (arXiv 2505.22617): a |log r| penalty on the top-covariance tokens.

    Loss ``-A r`` everywhere (no clip); on the top ``max(1, int(kl_cov_ratio * n_valid))`` valid
    tokens by ``(A - mean A)(logp - mean logp)`` it becomes ``-A r + ppo_kl_coef * |log r|``.
    """
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    valid = response_mask > 0
    with torch.no_grad():
        valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
        penalised = torch.zeros(log_prob.numel(), dtype=torch.bool, device=log_prob.device)
        if valid_idx.numel() > 0:
            adv_v = advantages.reshape(-1)[valid_idx]
            logp_v = log_prob.detach().reshape(-1)[valid_idx]
            cov = (adv_v - adv_v.mean()) * (logp_v - logp_v.mean())
            k = max(1, int(valid_idx.numel() * cfg.kl_cov_ratio))
            penalised[valid_idx[torch.topk(cov, k, largest=True).indices]] = True
        penalised = penalised.reshape(log_prob.shape)
    pg_losses = -advantages * ratio
    pg_losses = torch.where(penalised, pg_losses + cfg.ppo_kl_coef * log_ratio.abs(), pg_losses)
    pg_losses = _apply_is(pg_losses, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    metrics = {
        "clipfrac": 0.0,
        "clipfrac_lower": 0.0,
        "ppo_kl": _f(masked_mean(-log_ratio, response_mask)),
        "ppo_kl_abs": _f(masked_mean(log_ratio.abs(), response_mask)),
        "kl_cov_frac": _f(masked_mean(penalised.to(ratio.dtype), response_mask)),
    }
    return loss, metrics


def policy_loss_decoupled(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    cfg: PolicyLossParams = _DEFAULT,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    behav_log_prob: torch.Tensor,
) -> LossResult:
    """AReaL decoupled PPO: clip against the proximal policy, correct for the behaviour policy.

    ``old_log_prob`` is the proximal policy (recomputed at the start of the step),
    ``behav_log_prob`` the behaviour policy (rollout engine). ``r = exp(logp - prox)`` enters the
    clipped surrogate (+ dual clip); each token's loss is then multiplied by
    ``w = exp(prox - behav)``, detached, in fp32, with non-finite weights (and, if
    ``behav_imp_weight_cap`` is set, weights above it) set to 0. ``w`` already is the
    behaviour-policy correction: passing ``rollout_is_weights`` as well multiplies both.
    """
    log_ratio = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg_losses, metrics = _clipped_pg(ratio, advantages, response_mask, cfg)
    with torch.no_grad():
        behav_w = torch.exp(old_log_prob.detach().float() - behav_log_prob.detach().float())
        keep = torch.isfinite(behav_w) & (response_mask > 0)
        if cfg.behav_imp_weight_cap is not None:
            keep = keep & (behav_w <= cfg.behav_imp_weight_cap)
        behav_w = torch.where(keep, behav_w, torch.zeros_like(behav_w))
    pg_losses = _apply_is(pg_losses * behav_w.to(pg_losses.dtype), rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    metrics["ppo_kl"] = _f(masked_mean(-log_ratio, response_mask))
    metrics["behav_imp_weight"] = _f(masked_mean(behav_w, response_mask))
    metrics["behav_drop_frac"] = _f(masked_mean((~keep).float(), response_mask))
    return loss, metrics


PolicyLossFn = Callable[..., LossResult]

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "vanilla": policy_loss_vanilla,
    "gspo": policy_loss_gspo,
    "gpg": policy_loss_gpg,
    "clip_cov": policy_loss_clip_cov,
    "kl_cov": policy_loss_kl_cov,
    "geo_mean": policy_loss_geo_mean,
    "cispo": policy_loss_cispo,
    "decoupled": policy_loss_decoupled,
}

# Losses whose call needs the keyword-only ``behav_log_prob`` (behaviour-policy log-probs).
LOSSES_NEEDING_BEHAV: frozenset[str] = frozenset({"decoupled"})


def get_policy_loss(name: str) -> PolicyLossFn:
    """The loss registered under ``name`` (verl's ``policy_loss.loss_mode``)."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy loss {name!r}; valid: {', '.join(sorted(POLICY_LOSSES))}"
        ) from None

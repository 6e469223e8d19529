"""KL estimators against a reference policy, and entropy (pure torch).

Convention (verl, after Schulman's "Approximating KL divergence"): with ``lr = logprob -
ref_logprob`` for tokens sampled from the current policy,

- ``kl`` / ``k1``: ``lr``                                  (unbiased, high variance, can be < 0)
- ``abs``:         ``|lr|``
- ``mse`` / ``k2``: ``lr**2 / 2``
- ``low_var_kl`` / ``k3``: ``exp(-lr) - (-lr) - 1`` with ``-lr`` clamped to [-20, 20] and the
  result clamped to [-10, 10]                               (unbiased, low variance, >= 0)
- ``full``: exact ``KL(pi || ref) = sum_v pi(v) (log pi(v) - log ref(v))`` over the vocabulary;
  the two inputs are then [B, T, V] logits *or* log-probabilities (log_softmax is applied, which
  leaves log-probabilities unchanged), and the result is [B, T].

A trailing ``+`` (``k1+``, ``k3+``, ``low_var_kl+``, ...) keeps that estimator's value but takes
the gradient of k2, whose expected gradient is the gradient of the true KL (current verl).
"""

from __future__ import annotations

import torch

from asyncrl.algo.agg import agg_loss

KL_TYPES: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")


def _kl_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_type: str) -> torch.Tensor:
    if kl_type in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_type == "abs":
        return (logprob - ref_logprob).abs()
    if kl_type in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_type in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    if kl_type == "full":
        return full_kl(logprob, ref_logprob)
    raise ValueError(f"unknown kl type {kl_type!r}; valid: {', '.join(KL_TYPES)} (or k1+/k3+)")


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact per-token ``KL(pi || ref)`` from [..., V] logits or log-probs; returns [...]."""
    if logits.dim() < 1 or logits.shape != ref_logits.shape:
        raise ValueError(
            "kl type 'full' needs [B, T, V] logits or log-probs of equal shape, got "
            f"{tuple(logits.shape)} and {tuple(ref_logits.shape)}"
        )
    # Reduce in at least fp32 (bf16 logits lose the small differences KL is made of).
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    ref_logp = torch.log_softmax(ref_logits.to(dtype), dim=-1)
    # xlogy-style guard: a token with pi(v) = 0 contributes 0 even if ref(v) = 0 (-inf - -inf).
    diff = torch.where(logp.exp() > 0, logp - ref_logp, torch.zeros_like(logp))
    return (logp.exp() * diff).sum(dim=-1).to(logits.dtype)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate (see the module docstring for every ``kl_type``)."""
    if kl_type.endswith("+"):
        base = kl_type[:-1]
        if base == "full" or base not in KL_TYPES:
            raise ValueError(f"kl type {kl_type!r}: '+' applies to k1/abs/k2/k3 only")
        forward = _kl_forward(logprob, ref_logprob, base)
        backward = 0.5 * (logprob - ref_logprob).square()
        return backward - backward.detach() + forward.detach()
    return _kl_forward(logprob, ref_logprob, kl_type)


def kl_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
) -> torch.Tensor:
    """Aggregated KL loss term (``use_kl_loss``); multiply by ``kl_loss_coef``."""
    return agg_loss(kl_penalty(logprob, ref_logprob, kl_type), response_mask, loss_agg_mode)


def kl_in_reward(
    token_level_scores: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_type: str = "kl",
) -> torch.Tensor:
    """Token rewards with the KL penalty folded in (``use_kl_in_reward``): ``r - beta * kl``."""
    kl = kl_penalty(logprob, ref_logprob, kl_type).detach() * response_mask
    return token_level_scores - kl_coef * kl


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    beta: float,
    kl_type: str = "kl",
) -> tuple[torch.Tensor, float]:
    """verl's ``apply_kl_penalty``: token rewards ``r_t - beta * kl_t`` (``kl_t`` of the old
    policy against the reference, 0 outside the mask) and the batch's current KL, the mean over
    rows of each row's masked token mean (what an adaptive controller is fed). A row with no
    valid token counts as KL 0 in that mean, as in verl (``masked_mean`` over an empty row)."""
    mask = response_mask.to(token_level_scores.dtype)
    kld = kl_penalty(old_logprob, ref_logprob, kl_type).detach().to(mask.dtype) * mask
    rewards = token_level_scores - beta * kld
    per_row = kld.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    current = float(per_row.mean()) if per_row.numel() else 0.0
    return rewards, current


class FixedKLController:
    """A constant KL-in-reward coefficient (verl ``kl_ctrl.type: fixed``)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Fixed: nothing changes."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """verl's ``AdaptiveKLController`` (Ziegler et al., 2019): after each batch of
    ``n_steps`` sequences, ``beta *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) *
    n_steps / horizon``, so beta grows while the KL is above target and shrinks below it."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0, got "
                             f"{target_kl} and {horizon}")  # fmt: skip
        super().__init__(kl_coef)
        self.target, self.horizon = float(target_kl), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(
    kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000
) -> FixedKLController:
    """``fixed`` or ``adaptive`` (verl's ``algorithm.kl_ctrl.type``)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl_ctrl type {kind!r}; valid: fixed, adaptive")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Categorical entropy over the last axis: ``logsumexp(z) - sum softmax(z) * z``.

    Stable for large logits (no log of a softmax that underflowed). ``-inf`` logits (masked
    vocabulary entries) are clamped to the dtype's minimum so ``0 * -inf`` never makes a NaN.
    """
    logits = torch.clamp(logits, min=torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_bonus(
    token_entropy: torch.Tensor,
    response_mask: torch.Tensor,
    entropy_coeff: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, float]:
    """The term to *add* to the policy loss, ``-entropy_coeff * agg(H)``, and the mean entropy.

    ``token_entropy`` is [B, T] (from ``entropy_from_logits``); with ``entropy_coeff == 0`` the
    term is a zero that still belongs to the graph.
    """
    entropy = agg_loss(token_entropy, response_mask, loss_agg_mode)
    return -entropy_coeff * entropy, float(entropy.detach().item())

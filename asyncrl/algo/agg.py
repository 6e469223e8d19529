"""Masked reductions and loss aggregation over [batch, response_length] token matrices.

Invariant shared by every function here: a position whose mask is 0 contributes nothing, and an
empty mask (no valid token at all) yields 0, never NaN, in the value and in the gradient. Division
by a token count therefore goes through ``_safe_div`` (denominator replaced by 1 where it is 0;
the numerator is then 0 too) rather than verl's ``+ 1e-8``, so non-empty results are exact.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    # where(den == 0) the masked numerator is 0 as well, so 0 / 1 = 0 is the right answer and the
    # backward pass never sees a 0 denominator.
    den = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    return num / torch.where(den == 0, torch.ones_like(den), den)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is non-zero (mask values act as weights)."""
    # where() rather than multiply alone: a NaN/inf in a padded position must not leak (0*inf=NaN).
    prod = torch.where(mask.bool(), values * mask, torch.zeros_like(values))
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the masked positions; 0 where the mask is empty."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return _safe_div(masked_sum(values, mask, dim), count.to(values.dtype))


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked positions (whole tensor).

    With ``unbiased`` the Bessel correction n/(n-1) applies only when n > 1; verl raises for
    n <= 1, here a single valid value has variance 0 and an empty mask has variance 0.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum().to(values.dtype)
        var = torch.where(n > 1, var * n / torch.clamp(n - 1, min=1), var)
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` with statistics over the masked positions (as verl).

    Positions outside the mask are transformed too (callers multiply by the mask afterwards).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    norm_len: float | None = None,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregate a [B, T] per-token loss matrix into a scalar.

    - ``token-mean``: sum over valid tokens / number of valid tokens.
    - ``seq-mean-token-sum``: per-sequence token sum, mean over sequences.
    - ``seq-mean-token-mean``: per-sequence token mean, mean over sequences.
    - ``seq-mean-token-sum-norm``: per-sequence token sum / ``norm_len`` (a constant horizon,
      default ``loss_mask.shape[-1]``; Dr.GRPO's MAX_TOKENS), mean over sequences. This is current
      verl's form; early verl divided the *sum* over sequences by the horizon (no seq-mean).

    The sequence denominator is the number of rows ``B`` (fully masked rows count, contributing
    0), as verl does. ``num_tokens`` / ``num_seqs`` override the token / sequence denominators so
    that micro-batches summed under gradient accumulation reproduce the global-batch mean.
    """
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"agg_loss: loss_mat shape {tuple(loss_mat.shape)} != mask {tuple(loss_mask.shape)}"
        )
    if loss_agg_mode == "token-mean":
        den = loss_mask.sum() if num_tokens is None else num_tokens
        return _safe_div(masked_sum(loss_mat, loss_mask), den)
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = masked_sum(loss_mat, loss_mask, dim=-1)
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = masked_mean(loss_mat, loss_mask, dim=-1)
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        horizon = loss_mask.shape[-1] if norm_len is None else norm_len
        if horizon <= 0:
            raise ValueError(f"agg_loss: norm_len must be > 0, got {horizon}")
        seq_losses = masked_sum(loss_mat, loss_mask, dim=-1) / horizon
    else:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}"
        )
    den = seq_losses.numel() if num_seqs is None else num_seqs
    return _safe_div(seq_losses.sum(), den)

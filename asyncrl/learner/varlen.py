"""Variable-length attention for packed rows: each packed sequence attends only to itself.

A packed micro-batch (`asyncrl.learner.packing`) is one row of several sequences. transformers'
sdpa path reads their boundaries from the restarting `position_ids` and builds a dense
block-diagonal [T, T] mask: T² memory, and SDPA with an explicit mask leaves the flash kernel
for the masked "efficient" or math one, paying the attention FLOPs of the whole row. This
attention takes the boundaries as cumulative lengths (`cu_seq_lens_q`, the name transformers'
flash-attention kwargs use; `packing.Packed.attention_kwargs` builds them) and costs what each
sequence's own causal attention costs:

- on CUDA in bf16/fp16, torch's flash-attention varlen kernel (`torch.nn.attention.varlen`),
  one call per layer for the whole row;
- elsewhere (the CPU, fp32, dropout, a torch without the kernel), causal SDPA per sequence.

It is registered in transformers' attention registry under `NAME` and taken by a model whose
attention is the default `sdpa` (`enable`); a forward without cumulative lengths (the padded
path, with its padding mask) runs transformers' own sdpa attention unchanged, so one model
serves both. Its mask function builds sdpa's mask for padded forwards and none for packed ones
(no T² tensor). Models with sliding windows or other attention variants keep transformers'
path (`enable` says why not).
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl import llama

log = logging.getLogger(__name__)

NAME = "asyncrl_varlen"
#: Model types whose attention is plain causal softmax attention (checked by the equality
#: tests); the switch is refused for others.
_TYPES = ("qwen2", "qwen3", "llama")
#: The kwargs that carry the boundaries (transformers' `FlashAttentionKwargs` names).
CU_SEQ = "cu_seq_lens_q"
MAX_LEN = "max_length_q"


@functools.cache
def _kernel() -> tuple[Any, set[str], dict[str, Any] | None]:
    """torch's flash varlen kernel, its parameter names, and how it is asked for causal
    attention (its keyword moved between torch releases; None: neither, or no kernel, so it is
    not taken). Looked up at the first CUDA half-precision forward, not at import: its module
    imports torch._dynamo (seconds of CPU), which a CPU learner never needs."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None, set(), None
    params = set(inspect.signature(varlen_attn).parameters)
    causal = (
        {"window_size": (-1, 0)} if "window_size" in params
        else {"is_causal": True} if "is_causal" in params else None
    )  # fmt: skip
    return varlen_attn, params, causal


def why_not(model: torch.nn.Module) -> str | None:
    """Why `model`'s packed forwards keep transformers' attention (None: this one is taken)."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl == NAME:
        return None
    if impl != "sdpa":
        return f"attention implementation {impl!r}"
    if getattr(config, "model_type", None) not in _TYPES:
        return f"model type {getattr(config, 'model_type', None)!r}"
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(config, "layer_types", None) or ()
    ):
        return "sliding-window attention"
    if _interfaces() is None:
        return "transformers without attention registries"
    return None


def enable(model: torch.nn.Module) -> bool:
    """Switch `model` (an sdpa transformers model) to this attention; False where `why_not`
    refuses (its packed forwards then run transformers' own). Idempotent. The switch is
    permanent, not scoped to a forward: activation checkpointing re-runs the layers in the
    backward, outside any forward's scope, and must attend the same way."""
    why = why_not(model)
    if why is not None:
        return False
    interfaces = _interfaces()
    assert interfaces is not None  # why_not checked
    attention, masks, sdpa_mask = interfaces
    if NAME not in attention._global_mapping:
        attention.register(NAME, attention_forward)
        masks.register(NAME, _mask_for(sdpa_mask))
    if model.config._attn_implementation != NAME:
        model.config._attn_implementation = NAME
        log.info("learner: packed rows attend per sequence (varlen attention)")
    return True


def _interfaces() -> tuple[Any, Any, Any] | None:
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        from transformers.modeling_utils import AttentionInterface
    except ImportError:  # transformers < 4.53
        return None
    return AttentionInterface, AttentionMaskInterface, sdpa_mask


def _mask_for(sdpa_mask: Any) -> Any:
    def mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        # Packed forwards pass no padding mask: their boundaries travel as cumulative lengths,
        # and a dense block mask is exactly what this attention avoids building.
        if attention_mask is None:
            return None
        return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)

    return mask


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, T, D], key/value
    [B, H_kv, T, D] -> ([B, T, H, D], None). With `cu_seq_lens_q` (B = 1, a packed row): causal
    attention within each sequence; without: transformers' sdpa attention."""
    cu = kwargs.get(CU_SEQ)
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"varlen attention: a packed forward is one row, got {query.shape[0]}")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("varlen attention: sliding-window layers are not supported")
    dropout = dropout if module.training else 0.0
    if _flash_ok(query, dropout):
        out = _flash(query, key, value, cu, int(kwargs[MAX_LEN]), scaling)
    else:
        out = per_sequence(query, key, value, cu, scaling, dropout)
    return out[None], None


def _flash_ok(query: torch.Tensor, dropout: float) -> bool:
    # the kernel's causal keyword is None without the kernel (no parameters read)
    return (
        query.is_cuda
        and query.dtype in (torch.bfloat16, torch.float16)
        and dropout == 0.0
        and _kernel()[2] is not None
    )


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: Any
) -> torch.Tensor:
    """torch's flash varlen kernel on [T, H, D] layouts -> [T, H, D]."""
    kernel, params, causal = _kernel()
    q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))
    if "enable_gqa" in params:
        extra: dict[str, Any] = {"enable_gqa": q.shape[1] != k.shape[1]}
    else:  # K/V heads repeated for the query heads (transformers' `repeat_kv` order)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        extra = {}
    extra.update(causal or {})
    cu = cu.to(device=q.device, dtype=torch.int32)
    return kernel(q, k, v, cu, cu, max_len, max_len, scale=scale, **extra)


def per_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    scale: float | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal SDPA over each sequence of a packed row: q [1, H, T, D], k/v [1, H_kv, T, D],
    boundaries `cu` [S + 1] -> [T, H, D]. Each call sees only its sequence's keys, so the
    cost is Σ Lᵢ², not T²."""
    bounds = [int(b) for b in cu.tolist()]
    if bounds[0] != 0 or bounds[-1] != q.shape[2]:
        raise ValueError(f"varlen attention: boundaries {bounds[0]}..{bounds[-1]} do not cover "
                         f"the row's {q.shape[2]} tokens")  # fmt: skip
    gqa: dict[str, Any] = {}
    if q.shape[1] != k.shape[1]:
        if llama.NATIVE_GQA:
            gqa["enable_gqa"] = True
        else:
            k, v = (
                llama.repeat(k, q.shape[1] // k.shape[1]),
                llama.repeat(v, q.shape[1] // k.shape[1]),
            )
    outs = [
        F.scaled_dot_product_attention(
            q[:, :, a:b],
            k[:, :, a:b],
            v[:, :, a:b],
            is_causal=True,
            scale=scale,
            dropout_p=dropout,
            **gqa,
        )  # fmt: skip
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        if b > a
    ]
    return torch.cat(outs, dim=2)[0].transpose(0, 1)

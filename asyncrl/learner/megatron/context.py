"""Context parallelism for the Megatron learner: gathers along the sequence and a CP attention.

Every CP rank holds two of the 2·CP sequence chunks (`batch.cp_positions`). Attention needs all
keys and values: Transformer Engine's attention does that itself (ring exchange); Megatron's
local `DotProductAttention` refuses CP, so the local layer spec gets `ContextParallelAttention`
here: it all-gathers K and V over the CP group (the all-gather flavour of CP) and masks by the
tokens' global positions. Backends: any torch.distributed backend (gloo on the CPU, NCCL, HCCL).

Gradients: the K/V gather's backward sums over the CP group (each rank's queries contribute to
every key); the logprob gather's backward keeps the local slice only, because every CP rank
computes the same whole-sequence loss from the gathered values (Megatron's schedule multiplies
that loss by CP and DDP averages over DP×CP, so the gradients add up to exactly one loss).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.learner.megatron.batch import cp_order


class _Gather(torch.autograd.Function):
    """All-gather along `dim` over `group` (rank order); backward: the local slice of the
    incoming gradient, summed over the group first when `reduce`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, reduce: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.reduce = group, dim, reduce
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous()
        if ctx.reduce:  # all-reduce + slice: reduce-scatter semantics on every backend (gloo too)
            dist.all_reduce(grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, ctx.dim)[rank].contiguous(), None, None, None


def cp_group() -> Any:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def gather_positions(local: torch.Tensor) -> torch.Tensor:
    """[B, S/CP] per-position values of this CP rank -> [B, S] in sequence order (backward:
    this rank's slice of the gradient; see the module docstring)."""
    group = cp_group()
    cp = dist.get_world_size(group)
    gathered = _Gather.apply(local, group, 1, False)
    order = cp_order(gathered.shape[1], cp).to(gathered.device)
    return gathered.index_select(1, torch.argsort(order))


class _SumOwned(torch.autograd.Function):
    """All-reduce SUM over the CP group of values each rank fills only where it owns them;
    backward: the incoming gradient as is (each rank's own copy of the whole loss reaches the
    entries it owns, as `_Gather` without `reduce` does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=cp_group())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def sum_owned(local: torch.Tensor) -> torch.Tensor:
    """[B, R] values this CP rank computed where it holds the position (0 elsewhere) -> the
    whole [B, R] on every CP rank (backward: see `_SumOwned`)."""
    return _SumOwned.apply(local)


class ContextParallelAttention(torch.nn.Module):
    """Causal core attention for Megatron's local layer spec under CP (constructor and forward
    signatures of `megatron.core.transformer.dot_product_attention.DotProductAttention`).
    Query [sq, b, np, hn] holds this rank's positions, key/value [sq, b, ng, hn] likewise;
    returns the context [sq, b, np·hn]. No dropout: the learner scores tokens exactly."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:  # fmt: skip
        super().__init__()
        from megatron.core import parallel_state as ps

        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("context parallel attention (local spec) has no dropout: set "
                             "attention_dropout 0")  # fmt: skip
        if config.apply_query_key_layer_scaling or config.window_size is not None:
            raise ValueError("context parallel attention (local spec): no query-key layer "
                             "scaling or sliding window")  # fmt: skip
        tp = ps.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.softmax_fp32 = config.attention_softmax_in_fp32
        self._mask: dict[tuple, torch.Tensor] = {}

    def _visible(self, local: int, device: torch.device) -> torch.Tensor:
        """[sq, sk] True where a local query may attend a gathered key (causal, by position)."""
        group = cp_group()
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        key = (local, cp, rank, str(device))
        if key not in self._mask:
            order = cp_order(local * cp, cp)
            queries = order[rank * local : (rank + 1) * local]
            self._mask[key] = (queries[:, None] >= order[None, :]).to(device)
        return self._mask[key]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: Any = None,
                packed_seq_params: Any = None) -> torch.Tensor:  # fmt: skip
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("context parallel attention (local spec): no bias or packed rows")
        key = _Gather.apply(key, cp_group(), 0, True)
        value = _Gather.apply(value, cp_group(), 0, True)
        if self.heads > self.groups:
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        sq, b = query.shape[:2]
        scores = torch.matmul(query.permute(1, 2, 0, 3), key.permute(1, 2, 3, 0)) * self.scale
        if self.softmax_fp32:
            scores = scores.float()
        visible = self._visible(sq, scores.device)
        scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        context = torch.matmul(probs, value.permute(1, 2, 0, 3))  # [b, np, sq, hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, -1)

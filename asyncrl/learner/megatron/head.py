"""The Megatron learner's output layer at the response positions only, a chunk of tokens at a
time, vocab-parallel under tensor parallelism, with exact gradients.

Why: GPTModel's output layer projects every position (the prompt too) to its vocabulary shard,
[B, S, V/TP] logits that the old path then cast to fp32 and copied for the cross-entropy: at a
151,936-token vocabulary and 32k tokens a micro-batch, tens of GB. Here the last pipeline
stage's output layer passes its input through (`pass_hidden`: GPTModel then returns the final
hidden states [B, S, H]); the response positions are picked from them and `_VocabParallelScore`
projects them `chunk` tokens at a time, keeping per token only its logsumexp and entropy. The
backward recomputes each chunk's logits from the saved hidden states and the weight. Peak
extra memory: ~2-3 [chunk x V/TP] fp32 tensors (`chunked.chunk_tokens`: ~64 MB each on the CPU,
~512 MB on an accelerator) and one fp32 [V/TP x H] gradient accumulator (on an accelerator the
weight-gradient matmuls run in the weight's bf16/fp16, as ColumnParallelLinear's do).

The arithmetic is the old path's (`logits.token_logprobs`, Megatron's
`vocab_parallel_cross_entropy`): z = h @ W_local.T in the weight's dtype, cast to fp32, divided by
the temperature when it is > 0; the padded vocabulary rows (added to reach a multiple of TP)
are not tokens and are left out; the global max (all-reduce MAX over TP), then the sums of
exp(z - m), exp(z - m) * z and the target's logit (from the rank owning it) all-reduced over TP
give log p(target) = z_t - logsumexp(z) and the entropy logsumexp(z) - E_p[z]. Gradients (p the
softmax): d logp / dz = onehot(target) - p, d entropy / dz = -p * (z - E_p[z]), then through the
scale and the projection; the hidden states are the same on every TP rank (without sequence
parallelism; with it they were all-gathered), so their gradient is summed over TP, as
ColumnParallelLinear's backward does.

Context parallelism: each CP rank scores the response positions it holds and the [B, R] values
are summed over the CP group (each position belongs to one rank); the backward hands every rank
the gradient of its own copy of the whole loss, as `context.gather_positions` does for the old
path. Megatron is imported inside the functions only.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from asyncrl.learner.chunked import add_weight_grad, chunk_tokens, logit_grad
from asyncrl.learner.megatron.batch import cp_positions, entropy_from_partials
from asyncrl.learner.megatron.weights import unwrap

log = logging.getLogger(__name__)

#: fp32 bytes of one chunk's [tokens x V/TP] logits; None: `chunked.chunk_tokens`'s default for
#: the device (a module setting: the CPU emulation sets it small so that its tiny batches span
#: several chunks).
chunk_bytes: int | None = None


# -- the model side: the last stage returns its final hidden states --------------------------
def unsupported(model: Any) -> str | None:
    """Why `model`'s (a GPTModel's) logits are not just its output layer's projection of its
    final hidden states, or None. Such a model keeps its full-logits forward."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear

    config = model.config
    if type(model).forward is not GPTModel.forward or getattr(
        type(model), "_postprocess", None
    ) is not getattr(GPTModel, "_postprocess", None):
        return f"{type(model).__name__} has its own forward"
    if type(getattr(model, "output_layer", None)) is not ColumnParallelLinear:
        return "its output layer is not Megatron's ColumnParallelLinear"
    if getattr(config, "mtp_num_layers", None):
        return "multi-token prediction uses the output layer on its own hidden states"
    if getattr(config, "use_mup", False):
        return "MuP scales the logits after the output layer"
    if getattr(config, "defer_embedding_wgrad_compute", False):
        return "defer_embedding_wgrad_compute computes the output weight's gradient itself"
    return None


def pass_hidden(chunks: list[torch.nn.Module]) -> bool:
    """Make the output layer of the chunk that ends the model (if this rank holds it) return its
    input: the model's forward then returns the final hidden states [B, S, H]. False (and one log
    line) where the model is not one `unsupported` accepts: it keeps returning logits."""
    for chunk in chunks:
        model = unwrap(chunk)
        if not model.post_process:
            continue
        reason = unsupported(model)
        if reason is not None:
            log.warning("Megatron learner: full-vocabulary logits at every position (%s)", reason)
            return False
        layer = model.output_layer
        layer.forward = partial(_pass_through, layer)
        layer.passes_hidden = True
    return True


def _pass_through(layer: Any, input_: torch.Tensor, weight: torch.Tensor | None = None,
                  runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:  # fmt: skip
    """The output layer's place in GPTModel's forward: its input [S, B, H], whole along the
    sequence (all-gathered under sequence parallelism; `_VocabParallelScore` sums the gradient
    over TP, so the gather's backward only keeps this rank's slice)."""
    if layer.sequence_parallel:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        input_ = gather_from_sequence_parallel_region(
            input_, tensor_parallel_output_grad=False, group=layer.tp_group
        )
    return input_, None


def head_weight(chunk: torch.nn.Module) -> torch.Tensor | None:
    """The output weight [V/TP, H] of a chunk whose output layer `pass_hidden` changed (GPTModel's
    choice: the embedding's under tied embeddings), else None (its forward returns logits)."""
    model = unwrap(chunk)
    layer = getattr(model, "output_layer", None)
    if not model.post_process or not getattr(layer, "passes_hidden", False):
        return None
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return layer.weight


# -- the scores ----------------------------------------------------------------------------
def response_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      resp_index: torch.Tensor, temperature: float, vocab_size: int,
                      entropy: bool):  # fmt: skip
    """([B, R] logprobs, [B, R] entropy or None) of the response tokens from the final hidden
    states `hidden` [B, S', H] and `labels` [B, S'] at this rank's positions (S' = S/CP);
    `resp_index` [B, R] over whole sequences."""
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    rows, cols, local = _owned(resp_index, hidden.shape[1], cp, ps.get_context_parallel_rank())
    step = chunk_tokens(weight.shape[0], chunk_bytes, weight.device)
    lp, ent = _VocabParallelScore.apply(
        hidden[rows, local], weight, labels[rows, local], temperature, vocab_size, entropy, step
    )
    lp = lp.new_zeros(resp_index.shape).index_put((rows, cols), lp)
    ent = ent.new_zeros(resp_index.shape).index_put((rows, cols), ent) if entropy else None
    if cp > 1:  # every rank: the whole [B, R] (each position scored by the rank holding it)
        from asyncrl.learner.megatron.context import sum_owned

        lp = sum_owned(lp)
        ent = sum_owned(ent) if ent is not None else None
    return lp, ent


def _owned(resp_index: torch.Tensor, local_len: int, cp: int, rank: int) -> tuple:
    """(rows, cols, local positions) of the response entries whose predicting position this CP
    rank holds (all of them without CP)."""
    if cp == 1:
        rows, cols = torch.meshgrid(
            torch.arange(resp_index.shape[0], device=resp_index.device),
            torch.arange(resp_index.shape[1], device=resp_index.device),
            indexing="ij",
        )
        return rows.reshape(-1), cols.reshape(-1), resp_index.reshape(-1)
    held = cp_positions(local_len * cp, cp, rank).to(resp_index.device)
    local_of = torch.full((local_len * cp,), -1, dtype=torch.long, device=resp_index.device)
    local_of[held] = torch.arange(local_len, device=resp_index.device)
    where = local_of[resp_index]
    rows, cols = (where >= 0).nonzero(as_tuple=True)
    return rows, cols, where[rows, cols]


def _shard(weight: torch.Tensor, vocab_size: int) -> tuple[Any, int, int]:
    """(TP group, first vocabulary id of this rank's rows, how many of them are real tokens)."""
    from megatron.core import parallel_state as ps

    first = ps.get_tensor_model_parallel_rank() * weight.shape[0]
    valid = max(0, min(weight.shape[0], vocab_size - first))
    return ps.get_tensor_model_parallel_group(), first, valid


def _logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """One chunk's fp32 local logits (the old path's: a product in the weight's dtype, cast),
    divided by the temperature (in place) when it is > 0."""
    z = F.linear(h.to(weight.dtype), weight).to(torch.promote_types(weight.dtype, torch.float32))
    return z.div_(temperature) if temperature > 0 else z


def _reduce(t: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelScore(torch.autograd.Function):
    """(hidden [N, H], this rank's weight rows [V/TP, H], targets [N]) -> (logprobs [N], entropy
    [N]); saves the inputs and per-token logsumexp and entropy, never the logits."""

    @staticmethod
    def forward(ctx: Any, hidden, weight, targets, temperature, vocab_size, with_entropy, chunk):  # noqa: ANN001
        group, first, valid = _shard(weight, vocab_size)
        w, n = weight[:valid], hidden.shape[0]
        acc = torch.promote_types(weight.dtype, torch.float32)
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        lse, ent = torch.empty_like(logp), torch.zeros_like(logp)
        local_t = targets - first
        owned = (local_t >= 0) & (local_t < valid)
        local_t = torch.where(owned, local_t, 0)
        for s in range(0, n, chunk):
            z = _logits(hidden[s : s + chunk], w, temperature)
            m = z.amax(-1) if valid else torch.full_like(logp[s : s + chunk], torch.finfo(acc).min)
            m = _reduce(m, group, dist.ReduceOp.MAX)
            e = (z - m[:, None]).exp_()  # the one [chunk, V/TP] temporary beside z
            parts = torch.stack([
                e.sum(-1),
                e.mul_(z).sum(-1) if with_entropy else torch.zeros_like(m),
                z.gather(-1, local_t[s : s + chunk, None]).squeeze(-1) * owned[s : s + chunk]
                if valid else torch.zeros_like(m),
            ])  # fmt: skip
            total, weighted, picked = _reduce(parts, group)
            lse[s : s + chunk] = m + total.log()
            logp[s : s + chunk] = picked - lse[s : s + chunk]
            if with_entropy:
                ent[s : s + chunk] = entropy_from_partials(m, total, weighted)
        ctx.save_for_backward(hidden, weight, local_t, owned, lse, ent)
        ctx.settings = (temperature, vocab_size, with_entropy, chunk)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp, g_ent):  # noqa: ANN001
        hidden, weight, local_t, owned, lse, ent = ctx.saved_tensors
        t, vocab_size, with_entropy, chunk = ctx.settings
        group, _, valid = _shard(weight, vocab_size)
        w = weight[:valid]
        acc = lse.dtype
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.to(acc)
        use_ent = with_entropy and g_ent is not None
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h = torch.zeros_like(hidden) if want_h else None
        # fp32 sums over the chunks; the padded rows' gradient stays 0
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        for s in range(0, hidden.shape[0] if valid else 0, chunk):
            h, rows = hidden[s : s + chunk], slice(s, s + chunk)
            ge = g_ent[rows].to(acc) if use_ent else None
            z = _logits(h, w, t)
            dz = logit_grad(
                z, lse[rows], ent[rows], g_logp[rows], ge, local_t[rows], t, owned[rows]
            )
            dz = dz.to(weight.dtype)  # as the backward of the old path's `.float()` casts it
            if want_h:
                grad_h[rows] = dz @ w
            if want_w:
                add_weight_grad(grad_w[:valid], dz, h)
        if want_h:  # h is replicated over TP: its gradient is every rank's share summed
            grad_h = _reduce(grad_h, group)
        grad_w = grad_w.to(weight.dtype) if want_w else None
        return grad_h, grad_w, None, None, None, None, None

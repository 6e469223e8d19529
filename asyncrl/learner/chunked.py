"""Log-probabilities and entropy of target tokens from hidden states, the LM head projected a
chunk of tokens at a time: the [tokens x vocabulary] logits never exist whole.

Why: with a 151,936-token vocabulary one fp32 row of logits is 0.6 MB, so 16k response tokens
are ~10 GB per [T, V] tensor, and the plain path (logits, their fp32 cast, logsumexp, softmax
for the entropy, each kept for backward) holds several. Here the forward keeps, per token, only
its logsumexp and entropy; the backward recomputes each chunk's logits from the saved hidden
states and the head's weight and turns them into the gradients at once (verl's chunked entropy
and Liger's fused linear cross-entropy do the same). Peak extra memory: ~2-3 [chunk x V] fp32
tensors (`CHUNK_BYTES` each) and one fp32 [V x H] gradient accumulator.

The arithmetic is the plain path's: logits = h @ W.T (+ b) in the head's dtype, cast to fp32,
divided by the temperature when it is > 0 (SGLang's logprob is of logits / T; T = 0: raw), then
log softmax at the target and the entropy logsumexp(z) - sum softmax(z) * z. Gradients (z the
scaled logits, p = softmax(z)): d logp / dz = onehot(target) - p and
d entropy / dz = -p * (z - E_p[z]), then through the scale and the linear layer.

The model side (`output_head`, `forward`, `picked`): which models' heads are projected here (a
plain linear head of a type whose logits are nothing more) and their forward with the final
hidden states out and one position's logits in place of every position's.

FSDP2 (more than one rank): the head's weight is a DTensor sharded over the vocabulary (dim 0)
between forwards (the root reshards it after each forward), each rank scoring its own tokens.
The chunked function then gathers the whole [V, H] weight for its forward and again for its
backward (one all-gather each, as FSDP2 does for a layer), and hands autograd the weight's
gradient as that rank's shard: the [V, H] sum over its chunks reduce-scattered and divided by
the ranks (FSDP2's gradient average), accumulated into the sharded parameter's gradient beside
what FSDP2 reduces itself (a tied embedding's); gathered in the hidden states' dtype (FSDP2's
mixed-precision compute dtype over fp32 master shards). Where the root keeps its unsharded
weight from forward to backward instead (seen under a mixed-precision policy), that is a plain
parameter: the function uses it as on one process and FSDP2 reduces its gradient itself. Every
rank calls the function as many times as it runs forwards and backwards (the learner's count,
agreed across ranks), so the collectives pair up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.learner.lora import AdapterOff

#: fp32 bytes of one chunk's [tokens x vocabulary] logits (~110 tokens at a 152k vocabulary):
#: small against one [T x V] tensor at the lengths that matter, large enough for full matmuls
#: on the CPU.
CHUNK_BYTES = 64 << 20
#: The same on an accelerator (~880 tokens at a 152k vocabulary): each chunk's backward also
#: reads and writes the head's [V x H] gradient, which small chunks make the step's largest
#: cost on a GPU (measured on an H200 at Qwen2.5-1.5B's shape, `asyncrl bench shape`).
CHUNK_BYTES_ACCELERATOR = 512 << 20


def chunk_tokens(
    vocab: int, chunk_bytes: int | None = None, device: torch.device | None = None
) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take about `chunk_bytes` (default: by
    the `device` kind, `CHUNK_BYTES` on the CPU)."""
    default = CHUNK_BYTES if device is None or device.type == "cpu" else CHUNK_BYTES_ACCELERATOR
    return max(1, (chunk_bytes or default) // (4 * vocab))


#: Model types whose logits are exactly the LM head on the last hidden states (no soft-cap as
#: Gemma 2's, no scale as Cohere's or Granite's): the ones `output_head` projects in chunks.
PLAIN_HEAD_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


@dataclass
class Projection:
    """Hidden states [..., H] and the LM head (weight [V, H], bias [V] or None) that turns
    them into logits: the logits without computing them."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def logits(self) -> torch.Tensor:
        """The whole [..., V] fp32 logits (what the chunked path avoids; for checks)."""
        return F.linear(self.hidden, _whole(self.weight, self.hidden.dtype), self.bias).float()


#: The logits that predict response tokens: as a `Projection` (the final hidden states and the
#: LM head's weight, projected a chunk of tokens at a time), or, where the model's head is not
#: one `output_head` takes, the [..., V] logits themselves.
Logits = Projection | torch.Tensor


def token_logprobs(
    proj: Projection,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[target] for every position of `proj.hidden` ([...], fp32) and
    optionally the entropy, `chunk` tokens at a time (default: `chunk_tokens(V)`)."""
    lead = proj.hidden.shape[:-1]
    hidden = proj.hidden.reshape(-1, proj.hidden.shape[-1])
    step = chunk or chunk_tokens(proj.weight.shape[0], device=proj.weight.device)
    logp, ent = _ChunkedScore.apply(
        hidden, proj.weight, proj.bias, targets.reshape(-1), temperature, with_entropy, step
    )
    return logp.view(lead), (ent.view(lead) if with_entropy else None)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  temperature: float) -> torch.Tensor:  # fmt: skip
    """One chunk's fp32 logits, divided by the temperature (in place) when it is > 0."""
    z = F.linear(h, weight, bias).to(_acc(weight.dtype))
    return z.div_(temperature) if temperature > 0 else z


def tensor_cores(weight: torch.Tensor) -> bool:
    """Whether the head's gradient matmuls run in its own low precision (an accelerator's
    matrix units; fp32 inputs would take its far slower fp32 path), as autograd's backward of
    the plain path does; on the CPU they run in fp32."""
    return weight.device.type != "cpu" and weight.dtype in (torch.bfloat16, torch.float16)


def logit_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor,
    g_logp: torch.Tensor,
    g_ent: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    owned: torch.Tensor | None = None,
) -> torch.Tensor:
    """One chunk's gradient wrt its fp32 logits `z` (before the temperature; `z` is consumed):
    dz = g_logp * (onehot - p) - g_ent * p * (z - E[z]), p = exp(z - lse), E[z] = lse - ent,
    divided by T when it is > 0. `owned` (a vocabulary shard's): 1.0 where the target is in
    this shard's columns (`targets` then index the shard), 0.0 elsewhere."""
    p = (z - lse[:, None]).exp_()
    gl = g_logp[:, None]
    if g_ent is not None:
        dz = z.sub_((lse - ent)[:, None]).mul_(g_ent[:, None]).add_(gl).mul_(p).neg_()
    else:
        dz = p.mul_(gl).neg_()
    dz.scatter_add_(-1, targets[:, None], gl if owned is None else gl * owned[:, None])
    return dz.div_(temperature) if temperature > 0 else dz


def add_weight_grad(grad_w: torch.Tensor, dz: torch.Tensor, h: torch.Tensor) -> None:
    """grad_w (fp32 or fp64) += dz.T @ h: a `tensor_cores` matmul in dz's dtype (the weight's)
    where that applies, else in grad_w's dtype with no copy of the product."""
    if tensor_cores(dz):
        grad_w += dz.t() @ h.to(dz.dtype)
    else:
        grad_w.addmm_(dz.t().to(grad_w.dtype), h.to(grad_w.dtype))


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype the scores are computed in: fp32, or fp64 for an fp64 head (exactness checks)."""
    return torch.promote_types(dtype, torch.float32)


class _ChunkedScore(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias, targets [N]) -> (logprobs [N], entropy [N]);
    saves the inputs and per-token logsumexp and entropy, never the logits."""

    @staticmethod
    def forward(ctx: Any, hidden, weight, bias, targets, temperature, with_entropy, chunk):  # noqa: ANN001
        ctx.sharded = weight if _is_dtensor(weight) else None  # FSDP2: gathered again in backward
        weight = _whole(weight, hidden.dtype)
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=_acc(weight.dtype), device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.zeros_like(logp)
        for s in range(0, n, chunk):
            z = _chunk_logits(hidden[s : s + chunk], weight, bias, temperature)
            m = z.amax(-1, keepdim=True)
            e = (z - m).exp_()  # the one [chunk, V] temporary beside z
            total = e.sum(-1, keepdim=True)
            lse[s : s + chunk] = (m + total.log()).squeeze(-1)
            picked = z.gather(-1, targets[s : s + chunk, None]).squeeze(-1)
            logp[s : s + chunk] = picked - lse[s : s + chunk]
            if with_entropy:  # logsumexp(z) - sum p z, with p = e / total
                ent[s : s + chunk] = lse[s : s + chunk] - e.mul_(z).sum(-1) / total.squeeze(-1)
        kept = weight if ctx.sharded is None else None  # the gathered copy is not kept
        ctx.save_for_backward(hidden, kept, bias, targets, lse, ent)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp, g_ent):  # noqa: ANN001
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        if ctx.sharded is not None:
            weight = _whole(ctx.sharded, hidden.dtype)
        t, chunk = ctx.temperature, ctx.chunk
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        acc = _acc(weight.dtype)
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.to(acc)
        use_ent = ctx.with_entropy and g_ent is not None
        grad_h = torch.empty_like(hidden) if want_h else None
        # fp32 sums over the chunks (one matmul over all tokens in autograd's path)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if want_b else None
        for s in range(0, hidden.shape[0], chunk):
            h, rows = hidden[s : s + chunk], slice(s, s + chunk)
            ge = g_ent[rows].to(acc) if use_ent else None
            z = _chunk_logits(h, weight, bias, t)
            dz = logit_grad(z, lse[rows], ent[rows], g_logp[rows], ge, targets[rows], t)
            dz = dz.to(weight.dtype)  # as autograd's backward of `.float()` casts it
            if want_h:
                grad_h[rows] = dz @ weight
            if want_w:
                add_weight_grad(grad_w, dz, h)
            if want_b:
                grad_b += dz.to(acc).sum(0)
        if want_w and ctx.sharded is not None:  # reduced in the master weight's dtype
            grad_w = _shard_grad(grad_w.to(ctx.sharded.dtype), ctx.sharded)
        elif want_w:
            grad_w = grad_w.to(weight.dtype)
        grad_b = grad_b.to(bias.dtype) if want_b else None
        return grad_h, grad_w, grad_b, None, None, None, None


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _whole(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full tensor of an FSDP2-sharded (DTensor) weight (an all-gather), in `dtype` (the
    hidden states': FSDP2's mixed-precision compute dtype, the shards being fp32 masters), else
    `weight`."""
    if not _is_dtensor(weight):
        return weight
    return weight.full_tensor().to(dtype or weight.dtype)


def _shard_grad(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's [V, H] gradient sum as the gradient of the DTensor `like`: summed over the
    ranks onto each one's shard (a reduce-scatter) and divided by the ranks, as FSDP2 reduces
    the gradients of the parameters it gathers itself (their mean over the data-parallel ranks)."""
    from torch.distributed.tensor import DTensor, Partial

    mesh = like.device_mesh
    partial = DTensor.from_local(grad, mesh, [Partial()] * mesh.ndim, run_check=False)
    return partial.redistribute(mesh, like.placements) / mesh.size()


# -- the model side: what head a model has, and its forward without every position's logits --
def output_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The LM head that projects `model`'s final hidden states where it is a plain linear
    layer (so `chunked` can apply its weight): a peft model's is its base model's; the
    adapter-off reference of a LoRA policy reads the base layer of an adapted head (the
    adapter is off). An FSDP2-sharded head's weight is the DTensor the chunked function gathers
    (module docstring). None: the model's own forward computes the logits: an adapted head, or
    a sharded head with a bias or sharded otherwise than over the vocabulary on one mesh dim."""
    off = isinstance(model, AdapterOff)
    inner = model._policy[0] if off else model  # AdapterOff keeps the policy out of its tree
    if getattr(inner, "config", None) is None:
        return None
    if getattr(inner.config, "model_type", None) not in PLAIN_HEAD_TYPES:
        return None
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if off and hasattr(head, "get_base_layer"):
        head = head.get_base_layer()
    return head if type(head) is torch.nn.Linear and _gatherable(head) else None


def forward(model: torch.nn.Module, **inputs: Any) -> Any:
    """`model(**inputs)`; where `output_head` is taken, with the final hidden states out and
    the logits of one position only (unused: a forward computes some), never all of them."""
    if output_head(model) is None:
        return model(**inputs)
    return model(**inputs, output_hidden_states=True, logits_to_keep=1)


def picked(
    model: torch.nn.Module, out: Any, pick: Callable[[torch.Tensor], torch.Tensor]
) -> Logits:
    """The logits at the positions `pick` takes from a `forward`'s output `out` ([B, S, ...] ->
    [..., ...]): a `Projection` of its final hidden states, or its fp32 logits."""
    head = output_head(model)
    if head is None:
        return pick(out.logits).float()
    hidden = out.hidden_states[-1]
    _check_head(out.logits[:, -1], hidden[:, -1], head)
    return Projection(pick(hidden), head.weight, head.bias)


@torch.no_grad()
def _check_head(logits: torch.Tensor, hidden: torch.Tensor, head: torch.nn.Linear) -> None:
    """The one position's logits the forward computed are the head on its hidden state: else
    the chunked scores would not be the model's (a head that does more than project)."""
    weight = head.weight
    if _is_dtensor(weight):  # this rank's rows of the vocabulary (Shard(0), torch.chunk's split)
        mesh, local = weight.device_mesh, weight.to_local()
        start = mesh.get_local_rank() * -(-weight.shape[0] // mesh.size())
        weight, logits = local.to(hidden.dtype), logits[..., start : start + local.shape[0]]
    mine = torch.nn.functional.linear(hidden, weight, head.bias)
    if not torch.allclose(mine.float(), logits.float(), rtol=1e-2, atol=1e-3):
        raise RuntimeError(
            "the model's logits are not its LM head applied to its last hidden states: the "
            "chunked logprobs cannot score it (its model type must leave PLAIN_HEAD_TYPES)"
        )


def _gatherable(head: torch.nn.Linear) -> bool:
    """Whether the chunked function can take `head`'s weight: a plain tensor, or FSDP2's
    DTensor sharded over the vocabulary (Shard(0) on a 1-D mesh) without a bias."""
    weight = head.weight
    if not _is_dtensor(weight):
        return True
    from torch.distributed.tensor import Shard

    return head.bias is None and tuple(weight.placements) == (Shard(0),)

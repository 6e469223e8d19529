"""The Llama-family decoder's arithmetic (Qwen2, Llama) on a transformers model's own
parameters: what the hf engine's lean forward (`engine/hf/decoder.py`, inference with a KV
cache) and the learner's lean training forward (`learner/lean.py`, gradients) share.

Why: on the CPU a step of a small model is small matmuls wrapped in transformers' per-call
machinery (a 4-D mask built from the padding mask every call, the rotary module, output
dataclasses, cache objects, module hooks). This runs the same arithmetic with plain torch
functions on the parameters read from the model's modules at every call: weight updates made
in place (a sync, an optimizer step) are seen at once, nothing is copied or fused, and autograd
sees the very parameters the optimizer holds.

Only what it was checked against is taken (`unsupported` names why not otherwise, and callers
run transformers' forward): model type qwen2 or llama, SiLU MLP, default rotary embedding, no
sliding window or MLP bias, layers made of exactly the modules read below, no forward hooks
(FSDP's gathers and peft's adapters run in hooks or wrapper modules: refused).
`tests/test_decoder.py` and `tests/test_lean_learner.py` hold it to transformers' values.

Masks: a query attends to the allowed keys of a boolean mask; a padding query attends to
itself (the diagonal), so its unused outputs stay finite and never turn the real positions'
sums (or, in training, their gradients) into NaN (0 x NaN is NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

#: (layer index, the new positions' keys, values) -> the keys and values they attend to.
Join = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
#: (queries [B, H, S, D], keys, values [B, H_kv, T, D]) -> the attention output [B, H, S, D]:
#: what a layer runs in place of SDPA under a mask (`Llama.attention` with `allowed=None`
#: for a causal one).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_TYPES = ("qwen2", "llama")
#: SDPA takes `enable_gqa` (torch >= 2.5; the project allows 2.4).
NATIVE_GQA = torch.__version__ >= "2.5"
_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP = {"gate_proj", "up_proj", "down_proj", "act_fn"}
#: torch's SiLU module and transformers' own (the class `hidden_act: silu` builds).
_SILU = ("SiLU", "SiLUActivation")
_LAYER = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


def unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` is not one this module reproduces exactly (None: it is)."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) not in _TYPES:
        return f"model type {getattr(cfg, 'model_type', None)!r}"
    if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return "activation or tensor-parallel pretraining layout"
    if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "mlp_bias", False):
        return "sliding window or MLP bias"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope type {rope.get('rope_type', rope.get('type'))}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return "module layout"
    linears, norms = [model.lm_head], [inner.norm]
    for layer in layers:
        if {n for n, _ in layer.named_children()} != _LAYER:
            return f"layer modules {sorted(n for n, _ in layer.named_children())}"
        attn, mlp = dict(layer.self_attn.named_children()), dict(layer.mlp.named_children())
        if attn.keys() != _ATTN or mlp.keys() != _MLP or type(mlp["act_fn"]).__name__ not in _SILU:
            return "attention or MLP modules"
        linears += [*attn.values(), mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"]]
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    # Exactly these classes: a wrapper (an adapter layer, a quantised linear) computes
    # something other than `F.linear(x, weight, bias)` on the attributes read here.
    if any(type(m) is not torch.nn.Linear for m in linears):
        return "a projection that is not a plain torch.nn.Linear"
    if type(inner.embed_tokens) is not torch.nn.Embedding:
        return "an embedding that is not a plain torch.nn.Embedding"
    if any(not hasattr(n, "variance_epsilon") or list(n.children()) for n in norms):
        return "a norm that is not transformers' RMSNorm"
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "forward hooks (they would not run)"
    return None


class Llama:
    """The arithmetic of one model (its shapes read once, its parameters at every call)."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        self.model = model
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.scaling = float(getattr(model.model.rotary_emb, "attention_scaling", 1.0))
        self.layers = int(cfg.num_hidden_layers)  # transformers runs this many of `layers`
        self.group = self.heads // self.kv_heads  # query heads per K/V head
        # SDPA's own GQA where it is there and fast (5-8 % faster decode on CPU); with a mask
        # on CUDA it falls back to its math path (transformers' `use_gqa_in_sdpa`)
        device = next(model.parameters()).device
        self.native_gqa = self.group > 1 and NATIVE_GQA and device.type == "cpu"

    def blocks(
        self,
        h: torch.Tensor,
        pos: torch.Tensor,
        allowed: torch.Tensor | Attend,
        join: Join | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The residual stream after every decoder layer, from the embeddings `h` at positions
        `pos` under the boolean mask `allowed` (or attended by it: an `Attend`), and each
        layer's (keys, values): the new
        positions' own, or what `join(layer index, k, v)` makes of them (earlier keys and
        values put before them: a cache)."""
        cos, sin = self.rotary(pos, h.dtype)
        kv = []
        for i, layer in enumerate(self.model.model.layers[: self.layers]):
            q, k, v = self.qkv(layer, h, cos, sin)
            if join is not None:
                k, v = join(i, k, v)
            h = self.finish_layer(layer, h, (q, k, v), allowed)
            kv.append((k, v))
        return h, kv

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.model.model.embed_tokens.weight)

    def rotary(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, 1, S, D] at positions `pos` ([B, S]), as transformers' default rotary
        embedding computes them (in fp32, then cast)."""
        inv = self.model.model.rotary_emb.inv_freq
        freqs = pos[..., None].float() * inv.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]

    def qkv(
        self, layer: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [B, H, S, D], keys and values [B, H_kv, S, D] of `layer` on the residual
        stream `h` (normed here), rotary applied to queries and keys."""
        attn, x = layer.self_attn, norm(h, layer.input_layernorm)
        b, s, _ = x.shape
        q = linear(attn.q_proj, x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = linear(attn.k_proj, x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = linear(attn.v_proj, x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def finish_layer(
        self,
        layer: torch.nn.Module,
        h: torch.Tensor,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        allowed: torch.Tensor | Attend,
    ) -> torch.Tensor:
        """The residual stream after `layer`: attention of q over the allowed (k, v) (or what
        the `Attend` `allowed` makes of them), the output projection, then the MLP block."""
        q, k, v = qkv
        o = allowed(q, k, v) if callable(allowed) else self.attention(q, k, v, allowed)
        b, _, s, _ = q.shape
        o = o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        h = h + linear(layer.self_attn.o_proj, o)
        return h + mlp(layer.mlp, norm(h, layer.post_attention_layernorm))

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None
    ) -> torch.Tensor:
        """SDPA of q over (k, v) under the boolean mask `allowed`, or causal (query i sees keys
        0..i; SDPA's causal kernels skip the rest, a mask's compute it) where it is None."""
        causal = allowed is None
        if self.native_gqa:
            return F.scaled_dot_product_attention(
                q, k, v, allowed, is_causal=causal, enable_gqa=True
            )
        g = self.group  # K/V heads repeated for the query heads, as transformers' `repeat_kv`
        return F.scaled_dot_product_attention(
            q, repeat(k, g), repeat(v, g), allowed, is_causal=causal
        )

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head on the final norm of the residual stream `h` ([..., hidden])."""
        return linear(self.model.lm_head, norm(h, self.model.model.norm))


def repeat(kv: torch.Tensor, group: int) -> torch.Tensor:
    """[B, H_kv, T, D] -> [B, H_kv * group, T, D], each K/V head serving `group` query heads."""
    if group == 1:
        return kv
    b, h, t, d = kv.shape
    return kv[:, :, None].expand(b, h, group, t, d).reshape(b, h * group, t, d)


def prefill_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] booleans: causal over each row's non-padding keys, and the diagonal (a
    padding query attends to itself: finite, never read)."""
    s = mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
    keys = mask[:, None, None, :].bool()
    return (causal & keys) | torch.eye(s, dtype=torch.bool, device=mask.device)


def linear(proj: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, proj.weight, proj.bias)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def norm(x: torch.Tensor, module: Any) -> torch.Tensor:
    """RMSNorm as transformers' Llama/Qwen2 compute it: in fp32, scaled after the cast back."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return module.weight * x32.to(dtype)


def mlp(block: Any, x: torch.Tensor) -> torch.Tensor:
    return linear(block.down_proj, F.silu(linear(block.gate_proj, x)) * linear(block.up_proj, x))

"""A lean forward for the hf engine's Llama-family decoders (Qwen2, Llama), fp32-equal to
transformers' own.

Why: on the CPU engine a decode step of the embedded model is small matmuls wrapped in
transformers' per-call machinery (a 4-D mask built from the padding mask every call, the
rotary module, output dataclasses, cache objects, module hooks): at 64 padded rows the linear
layers are ~0.7 ms of a ~2.4 ms step. This runs the same arithmetic on the model's own
parameters (read from its modules at every call, so weight updates loaded into the model in
place are seen at once: nothing is copied or fused) and keeps the KV cache as the engine's
(keys, values) per layer, appended in place (`kvcache.append`). Measured on one core (the
embedded 2-layer model): decode 2.4 -> 1.6 ms at 64 rows, 1.4 -> 0.8 ms at 16; the default
run's rollout batch (8 prompts x 8 samples) 15.7 -> 11.9 ms of engine time; 256-row prefills
are matmul-bound and gain ~10 %.

Only what it was checked against is taken (`lean_forward_for` returns None otherwise and the
engine runs transformers' forward): model type qwen2 or llama, SiLU MLP, default rotary
embedding, no sliding window, in the model's dtype on any device, layers made of exactly the
modules the arithmetic below reads. `tests/test_decoder.py` holds it to transformers' logits
and KV on prefill (left padding) and decode (rows of different lengths).

Attention masks: a prefill row attends causally to its own non-padding positions; a padding
position attends to itself only, so its (unused) outputs stay finite and never turn the real
positions' sums into NaN (0 x NaN is NaN); decode rows attend to every unmasked column.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.engine.hf.kvcache import append

log = logging.getLogger(__name__)
KV = list[tuple[torch.Tensor, torch.Tensor]]
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, KV | None], tuple[torch.Tensor, KV]]
_TYPES = ("qwen2", "llama")
#: SDPA takes `enable_gqa` (torch >= 2.5; the project allows 2.4).
_NATIVE_GQA = torch.__version__ >= "2.5"
_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP = {"gate_proj", "up_proj", "down_proj", "act_fn"}
#: torch's SiLU module and transformers' own (the class `hidden_act: silu` builds).
_SILU = ("SiLU", "SiLUActivation")
_LAYER = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


def lean_forward_for(model: torch.nn.Module) -> Forward | None:
    """`forward(ids, mask, pos, kv) -> (last logits [B, V], kv)` for `model`, or None when
    the model is not one this module reproduces exactly (see the module docstring)."""
    if (why := _unsupported(model)) is not None:
        log.info("hf engine: transformers' forward for this model (%s)", why)
        return None
    return _Decoder(model)


def _unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` is not taken (None: it is)."""
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


class _Decoder:
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
        self.native_gqa = self.group > 1 and _NATIVE_GQA and device.type == "cpu"

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, kv: KV | None
    ) -> tuple[torch.Tensor, KV]:
        inner = self.model.model
        h = F.embedding(ids, inner.embed_tokens.weight)
        cos, sin = self._rotary(pos, h.dtype)
        allowed = _prefill_mask(mask) if kv is None else mask[:, None, None, :].bool()
        out: KV = []
        for i, layer in enumerate(inner.layers[: self.layers]):
            past = None if kv is None else kv[i]
            x = _norm(h, layer.input_layernorm)
            a, layer_kv = self._attention(layer, x, cos, sin, allowed, past)
            h = h + a
            h = h + _mlp(layer.mlp, _norm(h, layer.post_attention_layernorm))
            out.append(layer_kv)
        last = _norm(h[:, -1], inner.norm)
        return _linear(self.model.lm_head, last), out

    def _rotary(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, 1, S, D] at positions `pos` ([B, S]), as transformers' default rotary
        embedding computes them (in fp32, then cast)."""
        inv = self.model.model.rotary_emb.inv_freq
        freqs = pos[..., None].float() * inv.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]

    def _attention(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attn = layer.self_attn
        b, s, _ = x.shape
        q = _linear(attn.q_proj, x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = _linear(attn.k_proj, x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = _linear(attn.v_proj, x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if past is not None:
            k, v = append(past[0], k), append(past[1], v)
        if self.native_gqa:
            o = F.scaled_dot_product_attention(q, k, v, allowed, enable_gqa=True)
        else:  # K/V heads repeated for the query heads, as transformers' `repeat_kv`
            g = self.group
            o = F.scaled_dot_product_attention(q, _repeat(k, g), _repeat(v, g), allowed)
        o = o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return _linear(attn.o_proj, o), (k, v)


def _repeat(kv: torch.Tensor, group: int) -> torch.Tensor:
    """[B, H_kv, T, D] -> [B, H_kv * group, T, D], each K/V head serving `group` query heads."""
    if group == 1:
        return kv
    b, h, t, d = kv.shape
    return kv[:, :, None].expand(b, h, group, t, d).reshape(b, h * group, t, d)


def _prefill_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] booleans: causal over each row's non-padding keys, and the diagonal (a
    padding query attends to itself: finite, never read)."""
    s = mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
    keys = mask[:, None, None, :].bool()
    return (causal & keys) | torch.eye(s, dtype=torch.bool, device=mask.device)


def _linear(proj: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, proj.weight, proj.bias)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """RMSNorm as transformers' Llama/Qwen2 compute it: in fp32, scaled after the cast back."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(dtype)


def _mlp(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    return _linear(mlp.down_proj, F.silu(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))

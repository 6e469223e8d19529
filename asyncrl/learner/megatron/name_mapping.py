"""Hugging Face <-> Megatron-core names, layouts and tensor-parallel shards for dense
Llama / Qwen2 / Qwen3 / Mistral models and Qwen3-MoE (Megatron's local layer spec, or
Transformer Engine's).

Pure torch and no Megatron import: the whole mapping is tested on the CPU. One `Rule` per
Megatron parameter says which HF tensors make it, how (copy, QKV fusion, gate/up fusion, vocab
padding) and how it is split over tensor-parallel ranks. Layouts (megatron-core 0.16):

- `linear_qkv` is grouped by query group: for each of the `ng` KV heads, its `nh/ng` query heads,
  then its key head, then its value head, each `head_dim` rows. Megatron views the output as
  `[ng, (nh/ng + 2) * d]` and splits it; the bias follows the same order.
- `linear_fc1` of a gated MLP is `[gate; up]` within each TP shard (Megatron chunks the shard's
  output in two), so TP rank r holds `[gate_r; up_r]`, not a contiguous slice of `[gate; up]`.
- Column-parallel weights (`linear_qkv`, `linear_fc1`, embedding, output layer) split on dim 0,
  row-parallel ones (`linear_proj`, `linear_fc2`) on dim 1; norms are replicated. QKV groups stay
  whole because `ng % tp == 0` is required.
- The vocabulary is padded with zero rows to a multiple of the TP size; export strips them.
- With the Transformer Engine spec the two pre-norms live inside the fused linears
  (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`): `te_layernorm=True`. An MoE
  layer keeps its pre-MLP norm apart (`pre_mlp_layernorm.weight`) in both specs.
- Qwen3-MoE layers (Megatron's MoELayer with SequentialMLP experts): the router
  `mlp.router.weight` is HF's `mlp.gate.weight` (replicated); expert e's `linear_fc1` is
  `[gate_e; up_e]` and its `linear_fc2` HF's `down_proj`, named here by the GLOBAL expert id
  (`mlp.experts.local_experts.<e>.`). Expert-parallel rank r holds experts
  r·E/EP .. (r+1)·E/EP - 1 as its local experts 0..E/EP - 1 (`expert_local_name`), and the
  expert-tensor-parallel group (ETP, not TP) splits them like a dense MLP.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace

import torch

from asyncrl.config.moe_checks import expert_count, moe_layers

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe")
#: The mixture-of-experts model types of SUPPORTED (routed experts only, no shared expert).
MOE_SUPPORTED = ("qwen3_moe",)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


class MappingError(ValueError):
    """A model this mapping cannot represent, or tensors that do not fit it."""


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    padded_vocab_size: int | None = None
    num_experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    moe_ffn_hidden_size: int = 0
    """Each expert's MLP width."""
    moe_layers: tuple[int, ...] = ()
    """The layers whose MLP is a mixture of experts (the others are dense)."""

    @classmethod
    def from_hf_config(cls, cfg: Mapping) -> ModelShape:
        kind = cfg.get("model_type")
        if kind not in SUPPORTED:
            raise MappingError(
                f"model_type {kind!r} has no built-in Megatron mapping (supported: "
                f"{', '.join(SUPPORTED)}); install Megatron-Bridge for other models"
            )
        experts = any(cfg.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
        if experts and kind not in MOE_SUPPORTED:
            raise MappingError(f"mixture-of-experts model_type {kind!r} needs Megatron-Bridge "
                               f"(built in: {', '.join(MOE_SUPPORTED)})")  # fmt: skip
        heads = cfg["num_attention_heads"]
        return cls(
            **moe_fields(cfg),
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            ffn_hidden_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=kind in ("qwen3", "qwen3_moe"),
        )

    def padded_to(self, multiple: int) -> ModelShape:
        """The same model with its vocabulary padded up to a multiple of `multiple`."""
        return replace(self, padded_vocab_size=-(-self.vocab_size // multiple) * multiple)

    @property
    def vocab_rows(self) -> int:
        return self.padded_vocab_size or self.vocab_size

    @property
    def qkv_rows(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


def moe_fields(cfg: Mapping) -> dict:
    """ModelShape's MoE fields of an HF config ({} for a dense model; the MoE layers as
    transformers' Qwen3MoeDecoderLayer decides, `moe_checks.moe_layers`)."""
    experts = expert_count(cfg)
    if not experts:
        return {}
    if cfg.get("shared_expert_intermediate_size"):
        raise MappingError("shared experts need Megatron-Bridge (the built-in mapping has "
                           "routed experts only)")  # fmt: skip
    layers = moe_layers(cfg)
    return {"num_experts": experts, "moe_ffn_hidden_size": cfg["moe_intermediate_size"],
            "moe_layers": layers}  # fmt: skip


@dataclass(frozen=True)
class Rule:
    mcore: str
    """Megatron parameter name (global layer index)."""
    hf: tuple[str, ...]
    """The HF tensors it is made of, in order."""
    kind: str
    """copy | qkv | gate_up | vocab."""
    tp: str
    """How TP splits it: none | col | row | gate_up (col within gate and up)."""
    shape: tuple[int, ...]
    """Full (unsharded) Megatron shape."""
    layer: int | None = None
    expert: int | None = None
    """The global expert id of an expert's weight (split over EP, and over ETP, not TP)."""


def _layer_rules(s: ModelShape, i: int, te: bool) -> list[Rule]:
    h, m, p = s.hidden_size, f"decoder.layers.{i}.", f"model.layers.{i}."
    qkv = tuple(f"{p}self_attn.{x}_proj" for x in "qkv")
    out = [
        Rule(m + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"),
             (p + "input_layernorm.weight",), "copy", "none", (h,), i),
        Rule(m + "self_attention.linear_qkv.weight", tuple(f"{x}.weight" for x in qkv), "qkv",
             "col", (s.qkv_rows, h), i),
    ]  # fmt: skip
    if s.qkv_bias:
        out.append(
            Rule(m + "self_attention.linear_qkv.bias", tuple(f"{x}.bias" for x in qkv), "qkv",
                 "col", (s.qkv_rows,), i)
        )  # fmt: skip
    if s.qk_norm:
        for x in "qk":
            out.append(
                Rule(f"{m}self_attention.{x}_layernorm.weight", (f"{p}self_attn.{x}_norm.weight",),
                     "copy", "none", (s.head_dim,), i)
            )  # fmt: skip
    out.append(Rule(m + "self_attention.linear_proj.weight", (p + "self_attn.o_proj.weight",),
                    "copy", "row", (h, s.num_heads * s.head_dim), i))  # fmt: skip
    if i in s.moe_layers:
        return out + _moe_rules(s, i)
    f = s.ffn_hidden_size
    out += [
        Rule(m + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"),
             (p + "post_attention_layernorm.weight",), "copy", "none", (h,), i),
        Rule(m + "mlp.linear_fc1.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
             "gate_up", "gate_up", (2 * f, h), i),
        Rule(m + "mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",), "copy", "row", (h, f), i),
    ]  # fmt: skip
    return out


def _moe_rules(s: ModelShape, i: int) -> list[Rule]:
    """An MoE layer's pre-MLP norm (apart in both specs), router and every expert's MLP."""
    h, f, m, p = s.hidden_size, s.moe_ffn_hidden_size, f"decoder.layers.{i}.", f"model.layers.{i}."
    out = [
        Rule(m + "pre_mlp_layernorm.weight", (p + "post_attention_layernorm.weight",), "copy",
             "none", (h,), i),
        Rule(m + "mlp.router.weight", (p + "mlp.gate.weight",), "copy", "none",
             (s.num_experts, h), i),
    ]  # fmt: skip
    for e in range(s.num_experts):
        x, hf = f"{m}mlp.experts.local_experts.{e}.", f"{p}mlp.experts.{e}."
        out += [
            Rule(x + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"),
                 "gate_up", "gate_up", (2 * f, h), i, e),
            Rule(x + "linear_fc2.weight", (hf + "down_proj.weight",), "copy", "row", (h, f), i, e),
        ]  # fmt: skip
    return out


def expert_local_name(mcore_name: str, first_expert: int) -> str:
    """A global expert name (`local_experts.5.`) -> this EP rank's local one, whose first
    expert is `first_expert` (5 - 4 = `local_experts.1.` on EP rank 1 of 8 experts over 2)."""
    return _EXPERT.sub(lambda m: f".mlp.experts.local_experts.{int(m.group(1)) - first_expert}.",
                       mcore_name, count=1)  # fmt: skip


def rules(shape: ModelShape, te_layernorm: bool = False) -> list[Rule]:
    """Every Megatron parameter of the model, in HF order (embedding, layers, norm, head)."""
    h, v = shape.hidden_size, shape.vocab_rows
    out = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab",
                "col", (v, h))]  # fmt: skip
    for i in range(shape.num_layers):
        out += _layer_rules(shape, i, te_layernorm)
    out.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", "none", (h,)))
    if not shape.tie_word_embeddings:
        out.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab", "col", (v, h)))
    return out


# ---- layouts ----------------------------------------------------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: ModelShape) -> torch.Tensor:
    """HF q/k/v (weights or biases) -> Megatron's query-group-interleaved `linear_qkv`."""
    ng, per, d = s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim
    if s.num_heads % ng:
        raise MappingError(f"{s.num_heads} heads do not split into {ng} KV groups")
    if (q.shape[0], k.shape[0], v.shape[0]) != (s.num_heads * d, ng * d, ng * d):
        raise MappingError(
            f"q/k/v have {q.shape[0]}/{k.shape[0]}/{v.shape[0]} rows; {s.num_heads} heads and "
            f"{ng} KV heads of size {d} need {s.num_heads * d}/{ng * d}/{ng * d}"
        )
    rest = q.shape[1:]
    parts = (q.reshape(ng, per * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest))
    return torch.cat(parts, dim=1).reshape(ng * (per + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, s: ModelShape) -> tuple[torch.Tensor, ...]:
    """Inverse of `fuse_qkv`: (q, k, v) in HF layout."""
    ng, per, d = s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, (per + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return (q.reshape(ng * per * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest))


def to_megatron(rule: Rule, tensors: list[torch.Tensor], s: ModelShape) -> torch.Tensor:
    """Build one full Megatron tensor from its HF tensors (in `rule.hf` order)."""
    if len(tensors) != len(rule.hf):
        raise MappingError(f"{rule.mcore} is made of {len(rule.hf)} HF tensors, got {len(tensors)}")
    if rule.kind == "qkv":
        out = fuse_qkv(*tensors, s)
    elif rule.kind == "gate_up":
        out = torch.cat(tensors, dim=0)
    elif rule.kind == "vocab":
        (t,) = tensors
        pad = s.vocab_rows - t.shape[0]
        out = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad > 0 else t
    else:
        (out,) = tensors
    if tuple(out.shape) != rule.shape:
        raise MappingError(f"{rule.mcore}: HF tensors give shape {tuple(out.shape)}, "
                           f"the model needs {rule.shape}")  # fmt: skip
    return out


def to_hf(rule: Rule, tensor: torch.Tensor, s: ModelShape) -> list[tuple[str, torch.Tensor]]:
    """Split one full Megatron tensor back into its HF tensors."""
    if tuple(tensor.shape) != rule.shape:
        raise MappingError(f"{rule.mcore}: got shape {tuple(tensor.shape)}, expected {rule.shape}")
    if rule.kind == "qkv":
        parts: tuple[torch.Tensor, ...] = split_qkv(tensor, s)
    elif rule.kind == "gate_up":
        parts = tuple(torch.chunk(tensor, 2, dim=0))
    elif rule.kind == "vocab":
        parts = (tensor[: s.vocab_size],)
    else:
        parts = (tensor,)
    return list(zip(rule.hf, parts, strict=True))


def hf_to_megatron(
    get_hf: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor],
    s: ModelShape,
    te_layernorm: bool = False,
) -> Iterator[tuple[Rule, torch.Tensor]]:
    """Full Megatron tensors, one rule at a time; `get_hf` may be a dict or a lazy loader."""
    get = get_hf.__getitem__ if isinstance(get_hf, Mapping) else get_hf
    for rule in rules(s, te_layernorm):
        yield rule, to_megatron(rule, [get(name) for name in rule.hf], s)


def megatron_to_hf(
    mcore: Mapping[str, torch.Tensor], s: ModelShape, te_layernorm: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors from full Megatron tensors, streamed in HF order."""
    for rule in rules(s, te_layernorm):
        yield from to_hf(rule, mcore[rule.mcore], s)


# ---- tensor parallelism -----------------------------------------------------------------------
def _check_tp(s: ModelShape, tp: int, rule: Rule | None = None) -> None:
    if rule is not None and rule.expert is not None:  # split by the expert-tensor group
        if s.moe_ffn_hidden_size % tp:
            raise MappingError(f"expert_tensor_parallel_size {tp} must divide the experts' FFN "
                               f"size ({s.moe_ffn_hidden_size})")  # fmt: skip
        return
    if s.num_kv_heads % tp or s.num_heads % tp or s.ffn_hidden_size % tp or s.vocab_rows % tp:
        raise MappingError(
            f"tensor_model_parallel_size {tp} must divide the KV heads ({s.num_kv_heads}), heads "
            f"({s.num_heads}), FFN size ({s.ffn_hidden_size}) and padded vocab ({s.vocab_rows})"
        )


def tp_split(rule: Rule, tensor: torch.Tensor, tp: int, s: ModelShape) -> list[torch.Tensor]:
    """The `tp` shards of one full Megatron tensor, rank order (for an expert's tensor `tp` is
    the expert-tensor-parallel size)."""
    _check_tp(s, tp, rule)
    if rule.tp == "none" or tp == 1:
        return [tensor] * tp
    if rule.tp == "row":
        return list(torch.chunk(tensor, tp, dim=1))
    if rule.tp == "gate_up":
        gate, up = torch.chunk(tensor, 2, dim=0)
        return [torch.cat(p) for p in zip(torch.chunk(gate, tp), torch.chunk(up, tp))]
    return list(torch.chunk(tensor, tp, dim=0))


def tp_merge(rule: Rule, shards: list[torch.Tensor], s: ModelShape) -> torch.Tensor:
    """Inverse of `tp_split` (for replicated tensors, rank 0's copy)."""
    if rule.tp == "none" or len(shards) == 1:
        return shards[0]
    if rule.tp == "row":
        return torch.cat(shards, dim=1)
    if rule.tp == "gate_up":
        halves = [torch.chunk(x, 2, dim=0) for x in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0)


def layer_index(mcore_name: str) -> int | None:
    match = _LAYER.match(mcore_name)
    return int(match.group(1)) if match else None


def with_layer_offset(mcore_name: str, offset: int) -> str:
    """A pipeline stage's local name (`decoder.layers.3.`) -> the global one (`3 + offset`)."""
    i = layer_index(mcore_name)
    if i is None or offset == 0:
        return mcore_name
    return _LAYER.sub(f"decoder.layers.{i + offset}.", mcore_name, count=1)

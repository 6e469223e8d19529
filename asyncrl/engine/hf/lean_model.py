"""The hf engine's model read straight from a checkpoint's files, for the Llama-family decoders
`asyncrl.llama` reproduces (Qwen2, Llama): plain torch modules, laid out and named as
transformers' `Qwen2ForCausalLM` / `LlamaForCausalLM` lay them out, weights read with
safetensors.

Why: the engine serves such a model through `asyncrl.llama`'s arithmetic anyway (`decoder.py`),
and importing transformers' modeling stack to build it was most of the engine process's start
(its modeling, masking, loss and activation modules pull in torch._dynamo, sympy, scipy and
accelerate): the CPU default's engine process, from start to a loaded model, took 11.3-11.5 s
of CPU with transformers and takes 4.0-4.1 s this way (2026-11-28, the 2-core box).

Same parameters, same names: the learner's weight updates (named as transformers names them)
load into it in place (`weights.py`), kept versions are deep copies of it (`lanes.py`), and
`tests/test_lean_model.py` holds its logits to transformers' forward. Anything this does not
build exactly (another architecture or activation, a sliding window, rope scaling, quantised
or sharded-in-pickle weights, names that differ from the layout below) gives None, and the
server loads the model with transformers (`server.load_engine`). The CPU learner reads its policy
the same way (`learner/torch/lean_policy.py`: a subclass with transformers' training forward).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from asyncrl import llama

log = logging.getLogger(__name__)
#: architecture -> (model type, q/k/v bias, o_proj bias): Qwen2 has biases on q/k/v only;
#: Llama on all four when `attention_bias`.
ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def lean_model(
    path: str | Path, dtype: torch.dtype, device: str = "cpu", cls: type[CausalLM] | None = None
) -> nn.Module | None:
    """The checkpoint at `path` as plain torch modules in `dtype` on `device` (a `cls`, by
    default `CausalLM`: the learner's subclass adds a training forward), or None (why is logged)
    when it is not one this module builds exactly."""
    path, who = Path(path), "hf engine" if cls is None else "learner"
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        log.info("%s: transformers loads the model (config.json: %s)", who, e)
        return None
    if (why := _refused(cfg, path)) is not None:
        log.info("%s: transformers loads the model (%s)", who, why)
        return None
    c = _config(cfg)
    with torch.device("meta"):  # no initialisation: every parameter comes from the file
        model = (cls or CausalLM)(c)
    if (why := _load(model, _read_weights(path))) is not None:
        log.info("%s: transformers loads the model (%s)", who, why)
        return None
    model = model.to(dtype=dtype)
    # transformers computes the inverse frequencies in fp32 and keeps them so (a buffer)
    model.model.rotary_emb.inv_freq = inv_freq(c.head_dim, c.rope_theta)
    model = model.to(device)
    if (why := llama.unsupported(model)) is not None:  # the decoder must take it, or no lean
        log.info("%s: transformers loads the model (%s)", who, why)
        return None
    model.generation_config = _generation_config(path)
    return model.eval()


def _refused(cfg: dict[str, Any], path: Path) -> str | None:
    """Why the config or files are not ones built here (None: they are)."""
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or ARCHITECTURES.get(archs[0]) != cfg.get("model_type"):
        return f"architecture {archs} / model type {cfg.get('model_type')!r}"
    if cfg.get("hidden_act") != "silu" or cfg.get("pretraining_tp", 1) != 1:
        return "activation or tensor-parallel pretraining layout"
    if cfg.get("use_sliding_window") or cfg.get("mlp_bias"):
        return "sliding window or MLP bias"
    if any(t != "full_attention" for t in cfg.get("layer_types") or []):
        return f"layer types {sorted(set(cfg['layer_types']))}"
    rope = _rope(cfg)
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope type {rope.get('rope_type', rope.get('type'))}"
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0 or "rope_theta" not in rope:
        return "partial rotary factor, or no rope_theta"
    if cfg.get("quantization_config"):
        return "quantised weights"
    if not (path / WEIGHTS).is_file() and not (path / INDEX).is_file():
        return "no safetensors weights"
    return None


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope parameters in one dict: transformers >= 5 writes `rope_parameters` (with
    rope_theta); older configs `rope_theta` beside an optional `rope_scaling`."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "rope_theta" in cfg:
        rope.setdefault("rope_theta", cfg["rope_theta"])
    return rope


def _config(cfg: dict[str, Any]) -> SimpleNamespace:
    """config.json as attributes (what the engine and `asyncrl.llama` read), with the
    architecture's defaults where the file leaves them out."""
    out = SimpleNamespace(**cfg)
    heads = int(cfg["num_attention_heads"])
    out.num_key_value_heads = int(cfg.get("num_key_value_heads") or heads)
    out.head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    out.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
    out.rms_norm_eps = float(cfg.get("rms_norm_eps", 1e-6))
    out.rope_theta = float(_rope(cfg)["rope_theta"])
    qwen2 = cfg["model_type"] == "qwen2"
    out.qkv_bias = True if qwen2 else bool(cfg.get("attention_bias", False))
    out.o_bias = False if qwen2 else bool(cfg.get("attention_bias", False))
    return out


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (path / WEIGHTS).is_file():
        return load_file(path / WEIGHTS)
    shards = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
    return {k: v for shard in shards for k, v in load_file(path / shard).items()}


def _load(model: nn.Module, state: dict[str, torch.Tensor]) -> str | None:
    """Put `state`'s tensors into `model` (names and shapes exactly; a tied head is the
    embedding), or why not."""
    tied = model.config.tie_word_embeddings
    if tied and "lm_head.weight" in state:
        return "a tied head stored apart"
    want = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    want.pop("model.rotary_emb.inv_freq", None)  # not persistent: never in a file
    if set(state) != set(want):
        missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
        return f"weight names differ (missing {missing[:3]}, unexpected {extra[:3]})"
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(want[name].shape):
            return f"shape of {name}: {list(tensor.shape)}, expected {list(want[name].shape)}"
    if tied:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    model.load_state_dict(state, strict=True, assign=True)
    if tied:  # assign replaced both: one parameter again, as transformers ties them
        model.lm_head.weight = model.model.embed_tokens.weight
    return None


def _generation_config(path: Path) -> SimpleNamespace | None:
    """generation_config.json as attributes (the engine reads its EOS ids), if there is one."""
    try:
        return SimpleNamespace(**json.loads((path / "generation_config.json").read_text()))
    except (OSError, ValueError):
        return None


class RMSNorm(nn.Module):
    """transformers' Llama/Qwen2 RMSNorm parameters (`llama.norm` computes it)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps


class Rotary(nn.Module):
    """The default rotary embedding's inverse frequencies, as transformers computes them."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq(head_dim, theta), persistent=False)
        self.attention_scaling = 1.0


def inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """transformers' default rope: 1 / theta^(2i / d), computed in fp32."""
    # on the CPU even under a meta-device construction (whose kernels are slow to import)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta**exponents)


def _attention(c: SimpleNamespace) -> nn.Module:
    h, d = c.hidden_size, c.head_dim
    attn = nn.Module()
    attn.q_proj = nn.Linear(h, c.num_attention_heads * d, bias=c.qkv_bias)
    attn.k_proj = nn.Linear(h, c.num_key_value_heads * d, bias=c.qkv_bias)
    attn.v_proj = nn.Linear(h, c.num_key_value_heads * d, bias=c.qkv_bias)
    attn.o_proj = nn.Linear(c.num_attention_heads * d, h, bias=c.o_bias)
    return attn


def _layer(c: SimpleNamespace) -> nn.Module:
    layer, mlp = nn.Module(), nn.Module()
    layer.self_attn = _attention(c)
    mlp.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
    mlp.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
    mlp.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
    mlp.act_fn = nn.SiLU()
    layer.mlp = mlp
    layer.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
    layer.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
    return layer


class CausalLM(nn.Module):
    """The decoder's parameters under transformers' names (`model.layers.0.self_attn.q_proj`,
    `lm_head`, ...); its forward is `asyncrl.llama`'s, run by the engine's lean decoder."""

    def __init__(self, c: SimpleNamespace) -> None:
        super().__init__()
        self.config = c
        inner = nn.Module()
        # Given its (uninitialised) weight: Embedding's own init on the meta device would run
        # torch's Python reference kernels, whose import alone takes seconds.
        table = torch.empty(c.vocab_size, c.hidden_size)
        pad = getattr(c, "pad_token_id", None)
        inner.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, pad, _weight=table)
        inner.layers = nn.ModuleList(_layer(c) for _ in range(c.num_hidden_layers))
        inner.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        inner.rotary_emb = Rotary(c.head_dim, c.rope_theta)
        self.model = inner
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = inner.embed_tokens.weight

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("served by the hf engine's lean decoder (engine/hf/decoder.py)")

"""`actor_train` config + the HF model config -> the keyword arguments of Megatron-core 0.16.

Pure Python (no Megatron, no torch): the worker turns these dicts into
`parallel_state.initialize_model_parallel(**parallel)`, `TransformerConfig(**transformer)`,
`GPTModel(**model)`, `DistributedDataParallelConfig(**ddp)` and `OptimizerConfig(**optimizer)`,
so every pass-through is testable on the CPU.

`strategy_config` keys (ROLL's names; the MindSpeed table's knobs):
- parallel sizes: tensor_model_parallel_size, pipeline_model_parallel_size,
  virtual_pipeline_model_parallel_size (model chunks per pipeline rank, Megatron's interleaved
  schedule; needs PP >= 2), context_parallel_size (each sequence split over CP ranks, see
  `batch.cp_positions`), expert_model_parallel_size, expert_tensor_parallel_size (MoE models:
  checked against the model's experts by `check_experts`);
- sequence_parallel, recompute_granularity (full | selective), recompute_method (uniform |
  block), recompute_num_layers, recompute_modules, and moe_* keys -> TransformerConfig;
- use_distributed_optimizer, overlap_grad_reduce, overlap_param_gather, grad_reduce_in_fp32,
  bucket_size -> DistributedDataParallelConfig (and the optimizer where it has the field);
- transformer_impl: local | transformer_engine | auto (default: TE when importable);
- use_bridge: auto | true | false (Megatron-Bridge for the model and its HF conversion);
- override_transformer_config: a mapping applied last to TransformerConfig (MindSpeed's keys).
Anything else is an error naming the key, never silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncrl.config.moe_checks import expert_count, moe_layers
from asyncrl.config.strategy_keys import MEGATRON_DDP as DDP
from asyncrl.config.strategy_keys import MEGATRON_OWN as OWN
from asyncrl.config.strategy_keys import MEGATRON_PARALLEL as PARALLEL
from asyncrl.config.strategy_keys import MEGATRON_PREFIX, expert_problem, megatron_problem
from asyncrl.config.strategy_keys import MEGATRON_TRANSFORMER as TRANSFORMER

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class MegatronConfigError(ValueError):
    """A Megatron strategy_config that cannot be run; the message names the key."""


@dataclass(frozen=True)
class MegatronPlan:
    parallel: dict[str, Any]
    """initialize_model_parallel kwargs."""
    transformer: dict[str, Any]
    """TransformerConfig kwargs; `activation_func` is a name ("silu"), the worker resolves it."""
    model: dict[str, Any]
    """GPTModel kwargs besides config, spec and the pipeline-stage flags."""
    ddp: dict[str, Any]
    """DistributedDataParallelConfig kwargs."""
    optimizer: dict[str, Any]
    """OptimizerConfig kwargs; `params_dtype` is a name, like the transformer's dtypes."""
    transformer_impl: str
    use_bridge: bool | str


def check_options(sc: Mapping[str, Any]) -> None:
    """Every key one asyncrl maps (asyncrl.config.strategy_keys declares them), every value
    one a run can honour (the same rules `config validate` applies)."""
    known = set(PARALLEL + TRANSFORMER + DDP + OWN)
    for key in sc:
        if key not in known and not key.startswith(MEGATRON_PREFIX):
            raise MegatronConfigError(f"actor_train.strategy_args.strategy_config.{key} is not a "
                                      "Megatron option asyncrl knows (see asyncrl.learner."
                                      "megatron_args)")  # fmt: skip
    problem = megatron_problem(sc)
    if problem:
        raise MegatronConfigError(problem)


def check_layers(hf: Mapping[str, Any], sc: Mapping[str, Any]) -> None:
    """Every pipeline rank's virtual stages hold the same number of layers."""
    stages = (sc.get("pipeline_model_parallel_size") or 1) * (
        sc.get("virtual_pipeline_model_parallel_size") or 1
    )
    if hf["num_hidden_layers"] % stages:
        raise MegatronConfigError(
            f"the model's {hf['num_hidden_layers']} layers do not split into pipeline x virtual "
            f"stages ({stages}): adjust pipeline_model_parallel_size or "
            "virtual_pipeline_model_parallel_size"
        )


def check_experts(hf: Mapping[str, Any], sc: Mapping[str, Any], world: int) -> None:
    """Expert parallel sizes this model and these ranks can take (`expert_problem`)."""
    problem = expert_problem(hf, sc, world)
    if problem:
        raise MegatronConfigError(f"actor_train.strategy_args.{problem}")


def parallel_kwargs(sc: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: int(sc.get(k) or 1) for k in PARALLEL if k != "virtual_pipeline_model_parallel_size"}
    vpp = sc.get("virtual_pipeline_model_parallel_size")
    out["virtual_pipeline_model_parallel_size"] = vpp if vpp and vpp > 1 else None  # 1: no VPP
    if sc.get("expert_tensor_parallel_size") is None:  # Megatron's default: follow TP
        out["expert_tensor_parallel_size"] = None
    return out


def transformer_kwargs(hf: Mapping[str, Any], dtype: str, sc: Mapping[str, Any]) -> dict[str, Any]:
    """TransformerConfig for a Llama/Qwen2/Qwen3-family model (Qwen3-MoE's experts:
    `moe_kwargs`): RMSNorm, SwiGLU, RoPE, GQA, no dropout (the learner must score tokens
    exactly as the engine sampled them)."""
    heads = hf["num_attention_heads"]
    out: dict[str, Any] = {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "ffn_hidden_size": hf["intermediate_size"],
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf.get("rms_norm_eps", 1e-6),
        "gated_linear_unit": True,
        "activation_func": hf.get("hidden_act", "silu"),
        "add_bias_linear": False,
        "add_qkv_bias": hf.get("model_type") == "qwen2" or bool(hf.get("attention_bias")),
        "qk_layernorm": hf.get("model_type") in ("qwen3", "qwen3_moe"),
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "init_method_std": hf.get("initializer_range", 0.02),
        "attention_softmax_in_fp32": True,
        "variable_seq_lengths": True,  # micro-batches differ in rows (pipeline shapes are sent)
        "moe_token_dispatcher_type": "alltoall",  # allgather refuses variable_seq_lengths
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,  # needs apex's fused wgrad kernels
        "persist_layer_norm": False,
        "bf16": dtype == "bf16",
        "fp16": dtype == "fp16",
        "params_dtype": DTYPES[dtype],
        "pipeline_dtype": DTYPES[dtype],
    }
    out.update(moe_kwargs(hf))
    out.update({k: v for k, v in parallel_kwargs(sc).items() if v is not None})
    if out.get("virtual_pipeline_model_parallel_size"):
        # As Megatron's own training loop runs the interleaved schedule: separate isend/irecv
        # calls (with PP=2 the forward and backward messages share a peer; one batch of both
        # could pair a send with the wrong receive).
        out.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    out.update({k: sc[k] for k in TRANSFORMER if k in sc})
    out.update({k: v for k, v in sc.items() if k.startswith(MEGATRON_PREFIX)})
    out.update(dict(sc.get("override_transformer_config") or {}))
    return out


def moe_kwargs(hf: Mapping[str, Any]) -> dict[str, Any]:
    """TransformerConfig's MoE fields for Qwen3-MoE ({} for a dense model): its routed experts
    on Megatron's MoELayer, the router as transformers computes it: softmax over every expert,
    top-k, renormalised over the k when `norm_topk_prob` (Megatron's softmax of the top-k
    logits is the same), else the raw top-k probabilities (Megatron's pre-softmax). No shared
    expert, no auxiliary or z loss (the policy loss alone, as the torch learner's, which does not
    ask transformers for router logits), no capacity (no token is dropped), the experts one
    local MLP each (SequentialMLP: no grouped GEMM, which needs a GPU kernel)."""
    experts = expert_count(hf)
    if not experts:
        return {}
    layers = moe_layers(hf)
    n = hf["num_hidden_layers"]
    return {
        "num_moe_experts": experts,
        "moe_router_topk": hf["num_experts_per_tok"],
        "moe_ffn_hidden_size": hf["moe_intermediate_size"],
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_z_loss_coeff": None,
        "moe_expert_capacity_factor": None,
        "moe_grouped_gemm": False,
        "moe_layer_freq": 1 if len(layers) == n else [int(i in layers) for i in range(n)],
    }


def model_kwargs(hf: Mapping[str, Any], padded_vocab: int) -> dict[str, Any]:
    rope = hf.get("rope_parameters") or {}  # transformers >= 5 nests the RoPE settings here
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise MegatronConfigError("rope_scaling models need Megatron-Bridge (use_bridge: true)")
    if hf.get("use_sliding_window"):
        raise MegatronConfigError("sliding-window attention is not in the built-in Megatron path")
    return {
        "vocab_size": padded_vocab,
        "max_sequence_length": hf.get("max_position_embeddings", 4096),
        "position_embedding_type": "rope",
        "rotary_percent": 1.0,
        "rotary_base": int(hf.get("rope_theta") or rope.get("rope_theta", 10000)),
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
        "parallel_output": True,  # logits stay vocab-parallel: vocab_parallel_cross_entropy
    }


def ddp_kwargs(sc: Mapping[str, Any]) -> dict[str, Any]:
    out = {"grad_reduce_in_fp32": True, "check_for_nan_in_grad": True}
    out.update({k: sc[k] for k in DDP if k in sc})
    return out


def optimizer_kwargs(train: Any, optim: Any, dtype: str, sc: Mapping[str, Any]) -> dict[str, Any]:
    targs = train.training_args
    return {
        "optimizer": "sgd" if optim.name == "sgd" else "adam",  # Megatron's adam is AdamW
        "lr": targs.learning_rate,
        "min_lr": targs.learning_rate * optim.min_lr_ratio,
        "weight_decay": targs.weight_decay,
        "adam_beta1": optim.betas[0],
        "adam_beta2": optim.betas[1],
        "adam_eps": optim.eps,
        "clip_grad": float(targs.max_grad_norm),
        "bf16": dtype == "bf16",
        "fp16": dtype == "fp16",
        "params_dtype": DTYPES[dtype],
        "use_distributed_optimizer": bool(sc.get("use_distributed_optimizer", False)),
        "overlap_param_gather": bool(sc.get("overlap_param_gather", False)),
    }


def plan(
    train: Any, optim: Any, hf: Mapping[str, Any], padded_vocab: int, builtin: bool = True
) -> MegatronPlan:
    """Everything the Megatron worker needs, from `actor_train` and the HF config.json
    (`builtin=False`: Megatron-Bridge makes the model, so no GPTModel arguments)."""
    sc = dict(train.strategy_args.strategy_config)
    check_options(sc)
    check_layers(hf, sc)
    dtype = train.model_args.dtype or "bf16"
    return MegatronPlan(
        parallel=parallel_kwargs(sc),
        transformer=transformer_kwargs(hf, dtype, sc),
        model=model_kwargs(hf, padded_vocab) if builtin else {},
        ddp=ddp_kwargs(sc),
        optimizer=optimizer_kwargs(train, optim, dtype, sc),
        transformer_impl=sc.get("transformer_impl", "auto"),
        use_bridge=sc.get("use_bridge", "auto"),
    )

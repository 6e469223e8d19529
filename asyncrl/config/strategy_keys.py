"""The `strategy_config` keys each backend reads, declared once.

The readers take their keys from these tables (`strategy_option` refuses a key its backend does
not declare; Megatron's argument builder imports its tuples), and `check_strategy_keys` refuses
every other key with a did-you-mean, so a typo (`max_batch_sise`) never falls back silently to
a default. verl's names (its `fsdp_config` block) are read as asyncrl's where they mean the same
(`fold_verl_names`, when the config is loaded) and refused with the reason otherwise.

SGLang's strategy_config passes through to SGLang's server flags (`asyncrl.engine.sglang`):
SGLang's own argument parser judges those keys when the servers start.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from asyncrl.config.schema import Config, ConfigError

# -- Megatron (asyncrl.learner.megatron.args turns these into Megatron-core's arguments) --------
MEGATRON_PARALLEL = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    # mixture-of-experts models only (a dense model refuses both; `expert_problem`):
    # EP: each MoE layer's experts split over EP ranks (num_experts / EP each; must divide)
    "expert_model_parallel_size",
    # ETP: each expert's MLP split over ETP ranks; only the TP size (Megatron's default)
    "expert_tensor_parallel_size",
)
MEGATRON_TRANSFORMER = ("sequence_parallel", "recompute_granularity", "recompute_method")
MEGATRON_TRANSFORMER += ("recompute_num_layers", "recompute_modules")
MEGATRON_DDP = ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather")
MEGATRON_DDP += ("grad_reduce_in_fp32", "bucket_size")
MEGATRON_OWN = ("transformer_impl", "use_bridge", "override_transformer_config")
#: Keys with this prefix go to TransformerConfig as they are (its constructor judges the name).
MEGATRON_PREFIX = "moe_"
MEGATRON_CHOICES = {
    "recompute_granularity": ("full", "selective", None),
    "recompute_method": ("uniform", "block", None),
    "transformer_impl": ("local", "transformer_engine", "auto"),
    "use_bridge": ("auto", True, False),
}

#: (role, strategy_name) -> the strategy_config keys that backend reads there. A pair not listed
#: reads none (the reference and the critic run inside the learner, on actor_train's backend),
#: except the pass-through ones below.
READ: dict[tuple[str, str], tuple[str, ...]] = {
    ("actor_infer", "hf_infer"): ("max_batch_size",),  # asyncrl.engine.hf.launch
    # asyncrl.learner.torch.fsdp (FSDP2's CPUOffloadPolicy; one policy, both names)
    ("actor_train", "fsdp2_train"): ("offload_params", "offload_optimizer"),
    ("actor_train", "megatron_train"): (
        MEGATRON_PARALLEL + MEGATRON_TRANSFORMER + MEGATRON_DDP + MEGATRON_OWN
    ),
}
#: Backends whose strategy_config is handed on whole (SGLang's server flags and asyncrl's own
#: launch keys, asyncrl.engine.sglang).
PASS_THROUGH = {("actor_infer", "sglang")}

# verl's fsdp_config names under fsdp2_train: read as asyncrl's key where they mean the same ...
VERL_FSDP_NAMES = {
    "param_offload": "offload_params",
    "optimizer_offload": "offload_optimizer",
    "offload_policy": "offload_params",  # verl's FSDP2 path: CPUOffloadPolicy, as here
}
# ... refused with the reason where asyncrl does otherwise.
VERL_FSDP_REFUSED = {
    "grad_offload": "FSDP2 offloads gradients with the parameters: set offload_params",
    "fsdp_size": "it shards over every actor_train device, no hybrid-shard groups",
    "forward_prefetch": "FSDP2's own prefetching, no explicit forward prefetch",
    "reshard_after_forward": "it reshards after every forward, FSDP2's default",
    "wrap_policy": "it shards each decoder layer (HF's _no_split_modules) and the root",
    "mixed_precision": "it computes in actor_train.model_args.dtype over fp32 masters on "
    "accelerators",
    "model_dtype": "set actor_train.model_args.dtype",
    "dtype": "set actor_train.model_args.dtype",
    "use_orig_params": "an FSDP1 option; asyncrl shards with FSDP2",
    "ulysses_sequence_parallel_size": "no Ulysses sequence parallelism; megatron_train splits "
    "sequences with context_parallel_size",
    "use_torch_compile": "set actor.use_torch_compile",
    "use_dynamic_bsz": "set actor.use_dynamic_bsz",
    "use_remove_padding": "actor.use_dynamic_bsz drops the padding",
    "entropy_from_logits_with_chunking": "no such switch: it projects logprobs and entropy in "
    "token chunks",
    "entropy_checkpointing": "no such switch",
    "seed": "set the top-level seed",
    "full_determinism": "no such switch",
    "strategy": "set actor_train.strategy_args.strategy_name",
}
MEGATRON_SIZES_REASON = "a Megatron parallel size; fsdp2_train has no such parallelism: use "
MEGATRON_SIZES_REASON += "megatron_train"
# verl's Megatron offload switches (McoreEngineConfig): asyncrl's Megatron learner keeps its
# parameters, gradients and optimizer state on the device.
VERL_MEGATRON_REFUSED = {
    key: "asyncrl's megatron_train does not offload to the host"
    for key in ("param_offload", "grad_offload", "optimizer_offload")
}


def declared(role: str, name: str) -> tuple[str, ...]:
    """The strategy_config keys `name` reads as `role`'s backend."""
    return READ.get((role, name), ())


def strategy_option(role: str, strategy_args: Any, key: str, default: Any = None) -> Any:
    """`strategy_args.strategy_config[key]` (or `default`), for a key its backend declares in
    READ: a reader asking for another key is a bug, not a config error."""
    if key not in declared(role, strategy_args.strategy_name):
        raise KeyError(f"{role}: {strategy_args.strategy_name} declares no strategy_config key "
                       f"{key!r} (asyncrl.config.strategy_keys.READ)")  # fmt: skip
    value = strategy_args.strategy_config.get(key)
    return default if value is None else value


def fold_verl_names(cfg: Config) -> Config:
    """verl's fsdp_config names under fsdp2_train become asyncrl's (in place): one given, it is
    read; both given and different, one error line naming both."""
    for role in ("actor_train", "critic", "reference"):
        worker = getattr(cfg, role)
        if worker is None or worker.strategy_args.strategy_name != "fsdp2_train":
            continue
        sc = worker.strategy_args.strategy_config
        for verl, own in VERL_FSDP_NAMES.items():
            if verl not in sc:
                continue
            value = sc.pop(verl)
            if own in sc and sc[own] != value:
                where = f"{role}.strategy_args.strategy_config"
                raise ConfigError(f"{where}.{verl} (verl's name of {own}) is {value!r} and "
                                  f"{where}.{own} is {sc[own]!r}: set one")  # fmt: skip
            sc[own] = value
    return cfg


def check_strategy_keys(cfg: Config) -> None:
    """Every strategy_config key is one its backend reads, or one error line naming it."""
    for role in ("actor_train", "actor_infer", "reference", "critic"):
        worker = getattr(cfg, role)
        if worker is None or (role, worker.strategy_args.strategy_name) in PASS_THROUGH:
            continue
        for key in worker.strategy_args.strategy_config:
            _check_key(role, worker.strategy_args.strategy_name, str(key))
    _check_values(cfg)


def _check_values(cfg: Config) -> None:
    """The read keys' values a run can honour (Megatron's as its argument builder checks)."""
    train = cfg.actor_train.strategy_args
    problem = None
    if train.strategy_name == "megatron_train":
        problem = megatron_problem(train.strategy_config)
    if problem:
        raise ConfigError(f"actor_train.strategy_args.{problem}")
    infer = cfg.actor_infer.strategy_args
    size = infer.strategy_config.get("max_batch_size")
    if infer.strategy_name == "hf_infer" and size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError("actor_infer.strategy_args.strategy_config.max_batch_size must be "
                              f"a positive int, got {size!r}")  # fmt: skip


def _check_key(role: str, name: str, key: str) -> None:
    known = declared(role, name)
    if key in known or (name == "megatron_train" and key.startswith(MEGATRON_PREFIX)):
        return
    path = f"{role}.strategy_args.strategy_config.{key}"
    if role == "actor_train" and name == "fsdp2_train":
        if key in VERL_FSDP_REFUSED:
            raise ConfigError(f"{path}: verl's {key} is not supported by asyncrl's fsdp2_train "
                              f"({VERL_FSDP_REFUSED[key]})")  # fmt: skip
        if key in MEGATRON_PARALLEL:
            raise ConfigError(f"{path}: {MEGATRON_SIZES_REASON}")
    if name == "megatron_train" and key in VERL_MEGATRON_REFUSED:
        raise ConfigError(f"{path}: verl's {key} is not supported by asyncrl's megatron_train "
                          f"({VERL_MEGATRON_REFUSED[key]})")  # fmt: skip
    if not known:
        raise ConfigError(f"{path} is not read by {name} for {role} ({_reads_none(role)})")
    raise ConfigError(f"{path} is not read by {name}{_did_you_mean(key, known)}")


def _reads_none(role: str) -> str:
    if role == "actor_infer":
        return "it reads no strategy_config"
    return (
        f"the {role} runs inside the learner, on actor_train's backend: its strategy_config "
        "is not read"
    )


def _did_you_mean(key: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.5)
    if close:
        return f"; did you mean '{close[0]}'?"
    return f" (it reads {', '.join(known)})"


def expert_problem(hf: Mapping[str, Any], sc: Mapping[str, Any], world: int) -> str | None:
    """What in a megatron_train strategy_config's expert parallelism this model (its HF config)
    on `world` ranks cannot take, one line from `strategy_config.<key>`, or None.

    expert_model_parallel_size (EP): the experts of every MoE layer are split over EP ranks
    (each holds num_experts / EP of them and tokens travel to their experts' rank, Megatron's
    all-to-all dispatcher); it must divide the expert count. expert_tensor_parallel_size (ETP):
    each expert's MLP split over ETP ranks like a dense one over TP; only the TP size
    (Megatron's default when unset) is accepted. The expert layout, ETP x EP x expert-DP x PP,
    must fill the ranks as TP x CP x DP x PP does. Both are refused for a dense model."""
    ep = sc.get("expert_model_parallel_size") or 1
    etp = sc.get("expert_tensor_parallel_size")
    experts = int(hf.get("num_experts") or hf.get("num_local_experts")
                  or hf.get("n_routed_experts") or 0)  # fmt: skip
    if not experts:
        for key in ("expert_model_parallel_size", "expert_tensor_parallel_size"):
            if (sc.get(key) or 1) > 1:
                return (f"strategy_config.{key}: the model ({hf.get('model_type')!r}) is dense, "
                        "it has no experts to split")  # fmt: skip
        return None
    if experts % ep:
        return (f"strategy_config.expert_model_parallel_size {ep} must divide the model's "
                f"{experts} experts")  # fmt: skip
    tp, pp = sc.get("tensor_model_parallel_size") or 1, sc.get("pipeline_model_parallel_size") or 1
    if etp is not None and etp != tp:
        # Megatron builds it, but with ETP 2 over TP 1 (2 ranks, CPU emulation, megatron-core
        # 0.16.1) the forward was exact and the experts' SGD updates were not: their projection
        # on the one-device learner's 1.0, their norm 1.41x (an extra component as large)
        return (f"strategy_config.expert_tensor_parallel_size {etp}: only the TP size ({tp}, "
                "Megatron's default) is supported; other values are not verified")  # fmt: skip
    width = int(hf.get("moe_intermediate_size") or 0)
    if width and width % tp:
        return (f"strategy_config.tensor_model_parallel_size {tp} must divide the experts' FFN "
                f"size ({width}): experts are split over TP")  # fmt: skip
    if world % (tp * ep * pp):
        return (f"strategy_config.expert_model_parallel_size: {world} rank(s) are not a multiple "
                f"of expert-tensor x expert x pipeline parallel sizes ({tp} x {ep} x {pp})")  # fmt: skip
    if sc.get("moe_grouped_gemm") and sc.get("use_bridge") is not True:
        return ("strategy_config.moe_grouped_gemm needs use_bridge: true (the built-in mapping "
                "names SequentialMLP's experts, one MLP each)")  # fmt: skip
    if pp > 1 and sc.get("use_bridge") is not True:
        return ("strategy_config.pipeline_model_parallel_size > 1 with a mixture of experts "
                "needs use_bridge: true (the built-in HF export gathers experts on one stage)")  # fmt: skip
    if tp > 1 and not sc.get("sequence_parallel"):
        return ("strategy_config.tensor_model_parallel_size > 1 with a mixture of experts needs "
                "sequence_parallel: true (Megatron's MoE layer refuses to train without it)")  # fmt: skip
    return None


def megatron_problem(sc: Mapping[str, Any]) -> str | None:
    """What in a megatron_train strategy_config no run can honour (one line from
    `strategy_config.<key>`), or None; asyncrl.learner.megatron.args refuses the same."""
    for key, value in sc.items():
        if key in MEGATRON_CHOICES and value not in MEGATRON_CHOICES[key]:
            allowed = ", ".join(map(str, MEGATRON_CHOICES[key]))
            return f"strategy_config.{key}: {value!r} is not one of {allowed}"
    for key in MEGATRON_PARALLEL:
        value = sc.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):  # fmt: skip
            return f"strategy_config.{key} must be a positive int, got {value!r}"
    if sc.get("recompute_method") and not sc.get("recompute_num_layers"):
        return "strategy_config.recompute_method needs recompute_num_layers"
    vpp = sc.get("virtual_pipeline_model_parallel_size") or 1
    if vpp > 1 and (sc.get("pipeline_model_parallel_size") or 1) < 2:
        return ("strategy_config.virtual_pipeline_model_parallel_size needs "
                "pipeline_model_parallel_size >= 2 (virtual stages interleave pipeline ranks)")  # fmt: skip
    return None

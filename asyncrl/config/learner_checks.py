"""Checks of the learner-side workers: the critic, the reference, KL in the reward, Megatron's
parallel sizes, LoRA. Each failure is one ConfigError line naming the key."""

from __future__ import annotations

from asyncrl.config.rules import EPISODE_ESTIMATORS, KL_TYPES, one_of, positive
from asyncrl.config.schema import Config, ConfigError, ModelArgs, WorkerConfig


def check_critic(cfg: Config) -> None:
    """The critic runs inside the fsdp2_train learner, on its devices (sharded like the actor
    over several); only gae reads its values, so a critic with another estimator (verl would
    train it unread) is refused."""
    critic, alg, train = cfg.critic, cfg.algorithm, cfg.actor_train
    positive("algorithm.cliprange_value", alg.cliprange_value)
    positive("algorithm.critic_warmup", alg.critic_warmup, allow_zero=True)
    if critic is None:
        if alg.adv_estimator == "gae" or alg.critic_warmup:
            key = "adv_estimator: gae" if alg.adv_estimator == "gae" else "critic_warmup"
            raise ConfigError(f"algorithm.{key} needs a critic section (the value model)")
        return
    if alg.adv_estimator != "gae":
        raise ConfigError(
            f"critic: set, but algorithm.adv_estimator {alg.adv_estimator} reads no values "
            "(only gae does): remove the critic section or use gae"
        )
    for role, worker in (("critic", critic), ("actor_train", train)):
        if worker.strategy_args.strategy_name != "fsdp2_train":
            raise ConfigError(
                f"{role}.strategy_args.strategy_name: a critic with megatron_train is not "
                "available yet (the critic runs inside the fsdp2_train learner)"
            )
    mapping = list(critic.device_mapping)
    if mapping and mapping != list(train.device_mapping):
        raise ConfigError(
            f"critic.device_mapping {mapping} differs from actor_train.device_mapping "
            f"{list(train.device_mapping)}: the critic runs inside the learner, on its devices"
        )


def check_kl_in_reward(cfg: Config) -> None:
    """verl's use_kl_in_reward penalises token rewards before a learner-side estimator."""
    alg, ctrl = cfg.algorithm, cfg.algorithm.kl_ctrl
    one_of("algorithm.kl_penalty", alg.kl_penalty, tuple(k for k in KL_TYPES if k != "full"))
    positive("algorithm.kl_ctrl.kl_coef", ctrl.kl_coef, allow_zero=True)
    positive("algorithm.kl_ctrl.target_kl", ctrl.target_kl)
    positive("algorithm.kl_ctrl.horizon", ctrl.horizon)
    if not alg.use_kl_in_reward:
        return
    if alg.adv_estimator in EPISODE_ESTIMATORS:  # grpo, drgrpo, rloo: the rollout's
        raise ConfigError(
            f"algorithm.use_kl_in_reward: {alg.adv_estimator} is computed in the rollout workers, "
            "before any reference logprob; use reinforce_plus_plus(_baseline) or gae"
        )
    if cfg.actor_train.strategy_args.strategy_name != "fsdp2_train":
        raise ConfigError(
            "algorithm.use_kl_in_reward with megatron_train is not available yet (fsdp2_train)"
        )


def check_reference(cfg: Config) -> None:
    """What the learners also refuse (asyncrl/learner/reference.py), said by `config validate`;
    vocabulary and architecture need the model files and are checked when the learner is built."""
    ref = cfg.reference
    if ref is None:
        return
    if not (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward):
        raise ConfigError(
            "reference: set, but actor.use_kl_loss is false and so is "
            "algorithm.use_kl_in_reward (only they read the reference policy)"
        )
    mapping, train = list(ref.device_mapping), list(cfg.actor_train.device_mapping)
    if mapping and mapping != train:
        raise ConfigError(
            f"reference.device_mapping {mapping} differs from actor_train.device_mapping "
            f"{train}: the reference runs inside the learner, on actor_train's devices"
        )
    _check_reference_strategy(cfg.actor_train.strategy_args.strategy_name,
                              ref.strategy_args.strategy_name)  # fmt: skip
    if cfg.actor_train.strategy_args.strategy_name == "megatron_train":
        dtype = cfg.actor_train.model_args.dtype or "bf16"
        if ref.model_args.dtype not in (None, dtype):
            raise ConfigError(
                f"reference.model_args.dtype {ref.model_args.dtype} with megatron_train: the "
                f"reference is built in actor_train's dtype ({dtype}); leave it null or set {dtype}"
            )


# The reference runs inside the learner, on the learner's backend: what each learner builds
# it with, and the reference strategy names that say so (fsdp2_train, the section's default:
# "the learner's own backend").
REFERENCE_BACKENDS = {
    "fsdp2_train": ("a transformers model in the learner's process", ("fsdp2_train", "hf_infer")),
    "megatron_train": ("Megatron chunks in the actor's layout", ("fsdp2_train", "megatron_infer")),
}


def _check_reference_strategy(learner: str, name: str) -> None:
    how, names = REFERENCE_BACKENDS.get(learner, ("", (name,)))
    if name not in names:
        raise ConfigError(
            f"reference.strategy_args.strategy_name: {name} is not what the {learner} learner "
            f"runs (the reference is {how}); set {' or '.join(names)}"
        )


def check_unread_sizes(cfg: Config) -> None:
    """Worker sizes that only some roles read, refused elsewhere with the reason."""
    if cfg.actor_infer.infer_batch_size != WorkerConfig().infer_batch_size:
        raise ConfigError(
            "actor_infer.infer_batch_size: not read for actor_infer (the engines batch by their "
            "own scheduler: hf_infer's strategy_config.max_batch_size, SGLang's server args); "
            "it sizes logprob passes of actor_train, reference and critic"
        )
    for role in ("actor_train", "reference", "critic"):
        worker = getattr(cfg, role)
        if worker is not None and worker.num_gpus_per_worker != 1:
            raise ConfigError(
                f"{role}.num_gpus_per_worker: not read for {role} (the learner takes one device "
                "per rank from actor_train.device_mapping; Megatron's model parallel sizes are "
                "in strategy_config); it is the engines' tensor-parallel size (actor_infer)"
            )


MEGATRON_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "virtual_pipeline_model_parallel_size", "context_parallel_size")  # fmt: skip


def check_parallel_sizes(cfg: Config) -> None:
    """Megatron's model-parallel sizes (TP, PP, VPP, CP) a run can honour. The learner checks
    the rest of strategy_config, and what needs the model's config.json (layers per virtual
    stage), when it is built (`asyncrl.learner.megatron.args`)."""
    check_fsdp2(cfg)  # fsdp2_train's own strategy_config keys and what its sharding lacks
    train = cfg.actor_train
    sc, name = train.strategy_args.strategy_config, train.strategy_args.strategy_name
    where = "actor_train.strategy_args.strategy_config"
    sizes = {}
    for key in MEGATRON_SIZES:
        value = sc.get(key)
        value = 1 if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}.{key} must be a positive int, got {value!r}")
        if value > 1 and name != "megatron_train":
            raise ConfigError(f"{where}.{key}: {value} is a Megatron parallel size; {name} has "
                              "no such parallelism (use megatron_train)")  # fmt: skip
        sizes[key] = value
    tp, pp, vpp, cp = (sizes[k] for k in MEGATRON_SIZES)
    if vpp > 1 and pp < 2:
        raise ConfigError(
            f"{where}.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size "
            ">= 2 (virtual stages interleave pipeline ranks)"
        )
    world = max(1, len(train.device_mapping))
    if world % (tp * pp * cp):
        raise ConfigError(
            f"actor_train.device_mapping has {world} device(s), not a multiple of tensor x "
            f"pipeline x context parallel sizes ({tp} x {pp} x {cp})"
        )


FSDP_OFFLOAD = ("offload_params", "offload_optimizer")


def check_fsdp2(cfg: Config) -> None:
    """fsdp2_train with > 1 device shards with FSDP2 (asyncrl.learner.torch.fsdp). Its CPU
    offload is FSDP2's CPUOffloadPolicy: parameters, gradients and (the optimizer steps where
    its parameters are) the optimizer state on the host, all together, for actor_train's shards
    (the policy and its frozen reference) on accelerators; a machine without one refuses it
    before the run (asyncrl.preflight: on the CPU there is nothing to offload). Refused here: a
    value that is not true/false, the two keys set apart (one policy moves both), offload with
    one device (nothing is sharded), and offload keys in the critic's or reference's sections
    (sharded without offload)."""
    if cfg.actor_train.strategy_args.strategy_name != "fsdp2_train":
        return
    for section in ("actor_train", "critic", "reference"):
        worker = getattr(cfg, section, None)
        if worker is None:
            continue
        where = f"{section}.strategy_args.strategy_config"
        values = {k: worker.strategy_args.strategy_config.get(k) for k in FSDP_OFFLOAD}
        for key, value in values.items():
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"{where}.{key} must be true or false, got {value!r}")
            if value and section != "actor_train":
                raise ConfigError(
                    f"{where}.{key}: the {section} is sharded without CPU offload (only "
                    "actor_train's shards offload): remove it"
                )
        if section == "actor_train" and any(values.values()):
            _check_actor_offload(cfg, where, values)


def _check_actor_offload(cfg: Config, where: str, values: dict) -> None:
    params, optimizer = (values[k] for k in FSDP_OFFLOAD)
    if None not in (params, optimizer) and params != optimizer:
        raise ConfigError(
            f"{where}: offload_params={params} and offload_optimizer={optimizer}: FSDP2 "
            "offloads parameters, gradients and optimizer state together; set both alike"
        )
    devices = len(cfg.actor_train.device_mapping)
    if devices < 2:
        key = "offload_params" if params else "offload_optimizer"
        raise ConfigError(
            f"{where}.{key}: CPU offload applies to FSDP2's shards, and actor_train."
            f"device_mapping has {devices} device(s): give it >= 2 or remove the key"
        )


LORA_FIELDS = (
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "lora_target_exclude",
    "use_rslora",
)


def check_lora(cfg: Config) -> None:
    """LoRA is the fsdp2_train actor's (peft); the engines get the adapter by weight sync."""
    defaults = ModelArgs()
    for role in ("actor_infer", "reference", "critic"):
        worker = getattr(cfg, role)
        for name in LORA_FIELDS if worker is not None else ():
            if getattr(worker.model_args, name) != getattr(defaults, name):
                raise ConfigError(
                    f"{role}.model_args.{name}: LoRA is set on actor_train only (the engines "
                    "receive the adapter by weight sync; the critic and reference train none)"
                )
    args, path = cfg.actor_train.model_args, "actor_train.model_args"
    if args.lora_rank < 0:
        raise ConfigError(f"{path}.lora_rank: {args.lora_rank} is negative (0 turns LoRA off)")
    if args.lora_rank == 0:
        return
    if cfg.actor_train.strategy_args.strategy_name != "fsdp2_train":
        raise ConfigError(
            f"{path}.lora_rank: LoRA needs the fsdp2_train learner, not "
            f"{cfg.actor_train.strategy_args.strategy_name}"
        )
    positive(f"{path}.lora_alpha", args.lora_alpha)
    if not 0.0 <= args.lora_dropout < 1.0:
        raise ConfigError(f"{path}.lora_dropout: {args.lora_dropout} is not in [0, 1)")
    targets = args.target_modules
    if isinstance(targets, str) and targets != "all-linear":
        raise ConfigError(
            f"{path}.target_modules: {targets!r} is neither all-linear nor a list of module names"
        )
    if isinstance(targets, list) and not (targets and all(targets)):
        raise ConfigError(f"{path}.target_modules: the list must name at least one module")
    infer = cfg.actor_infer.strategy_args.strategy_name
    if cfg.weight_sync.lora_sync == "adapter" and infer != "hf_infer":
        raise ConfigError(
            f"weight_sync.lora_sync: adapter needs hf_infer engines; with {infer} use native "
            "(SGLang's own LoRA endpoints) or merge (full weights with the adapter merged in)"
        )
    if cfg.weight_sync.lora_sync == "native":
        check_lora_native(cfg)


#: LoRA targets SGLang serves in every supported release (0.5.6's SUPPORTED_LORA_TARGET_MODULES,
#: less its fused names, which peft never produces).
SGLANG_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: SGLang stacks q/k/v and gate/up into fused weights: an adapter on one member needs these
#: (a missing k_proj it zeroes; lora.py `normalize_qkv_proj`, `normalize_gate_up_proj`).
SGLANG_STACKED = {
    ("q_proj", "k_proj", "v_proj"): ("q_proj", "v_proj"),
    ("gate_proj", "up_proj"): ("gate_proj", "up_proj"),
}


def check_lora_native(cfg: Config) -> None:
    """`lora_sync: native`: SGLang engines load each version's PEFT adapter from `lora_dir`."""
    args, path = cfg.actor_train.model_args, "actor_train.model_args"
    infer = cfg.actor_infer.strategy_args.strategy_name
    if infer != "sglang":
        raise ConfigError(
            f"weight_sync.lora_sync: native is SGLang's LoRA path; {infer} engines take adapter"
        )
    if cfg.cluster.address.strip() and not cfg.weight_sync.lora_dir.strip():
        raise ConfigError(
            "weight_sync.lora_dir: multi-node (cluster.address) needs a directory every "
            "engine's node shares for lora_sync: native (output_dir is the driver's own)"
        )
    if args.lora_target_exclude:
        raise ConfigError(
            f"{path}.lora_target_exclude: SGLang's native LoRA path needs the adapter on every "
            "layer of a target module: use lora_sync merge, or drop the exclusion"
        )
    targets = args.target_modules
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(SGLANG_LORA_TARGETS))
        if unknown:
            raise ConfigError(
                f"{path}.target_modules: SGLang cannot serve a LoRA on {unknown[0]!r} (it "
                f"takes {', '.join(SGLANG_LORA_TARGETS)} or all-linear): use lora_sync merge"
            )
        for members, needed in SGLANG_STACKED.items():
            if set(members) & set(targets) and not set(needed) <= set(targets):
                raise ConfigError(
                    f"{path}.target_modules: SGLang fuses {'/'.join(members)} and needs the "
                    f"adapter on {' and '.join(needed)}: add them, or use lora_sync merge"
                )


def check_packing(cfg: Config) -> None:
    """verl's `use_dynamic_bsz`: sequence packing under `ppo_max_token_len_per_gpu` real tokens
    per micro-batch; the fsdp2_train learner packs (asyncrl.learner.packing), Megatron not yet."""
    actor = cfg.actor
    positive("actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu)
    name = cfg.actor_train.strategy_args.strategy_name
    if actor.use_dynamic_bsz and name != "fsdp2_train":
        raise ConfigError(
            f"actor.use_dynamic_bsz: sequence packing is not available with {name} yet "
            "(the fsdp2_train learner packs; Megatron's THD format is not wired): set it false"
        )

"""Checks that types alone cannot express. Each failure is one ConfigError line naming the key.

Every number is finite and in its range (ports 0..65535, timeouts > 0, intervals >= 0, learning
rates > 0), every name is one the run knows (strategies, losses, the reward function), and the
sampling parameters follow SGLang's rules, so nothing a run would refuse late (or honour
wrongly) gets past `asyncrl config validate`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from asyncrl.config.async_checks import check_async
from asyncrl.config.cluster_checks import check_cluster
from asyncrl.config.learner_checks import (
    check_critic,
    check_kl_in_reward,
    check_lora,
    check_packing,
    check_parallel_sizes,
    check_reference,
    check_unread_sizes,
)
from asyncrl.config.moe_checks import check_moe
from asyncrl.config.plan import derive_plan
from asyncrl.config.rules import (  # the name tables are re-exported: tests read them here
    ADV_ESTIMATORS,
    CHECKPOINT_CONTENTS,
    EPISODE_BATCH_ESTIMATORS,
    EPISODE_ESTIMATORS,
    INT64,
    KL_TYPES,
    LOSS_AGG_MODES,
    LOSS_MODES,
    MAX_DEVICES,
    MIN_TEMPERATURE,
    REPLACED_STRATEGIES,
    RESUME_MODES,
    RS_CRITERIA,
    STRATEGIES,
    check_threads,
    one_of,
    port,
    positive,
    within,
)
from asyncrl.config.schema import (
    FIELD_ALIASES,
    Config,
    ConfigError,
    GeneratingArgs,
    TrainingArgs,
    WorkerConfig,
)
from asyncrl.config.strategy_keys import check_strategy_keys
from asyncrl.config.verl_actor import check_actor as check_verl_actor


def validate(cfg: Config) -> None:
    _check_numbers(cfg, "")
    _check_sizes(cfg)
    _check_loop(cfg)
    check_cluster(cfg)
    for role in ("actor_train", "actor_infer", "reference", "critic"):
        worker = getattr(cfg, role)
        if worker is not None:
            _check_worker(role, worker)
    _check_algorithm(cfg)
    check_async(cfg)
    check_critic(cfg)
    check_kl_in_reward(cfg)
    _check_actor(cfg)
    check_verl_actor(cfg)
    check_reference(cfg)
    check_parallel_sizes(cfg)
    check_strategy_keys(cfg)  # after the checks that name a read key's own rule
    _check_unread(cfg)
    check_unread_sizes(cfg)
    check_lora(cfg)
    check_packing(cfg)
    check_moe(cfg)
    derive_plan(cfg)  # the step plan: sizes that contradict each other are refused
    if cfg.env is not None:
        _check_env(cfg)
    _check_reward(cfg.rollout.reward_fn)
    check_threads(cfg.threads.learner, cfg.threads.engine)


def _check_numbers(node: Any, path: str) -> None:
    """Every float finite (YAML reads `.inf` and `.nan`), every int a 64-bit integer. The
    pass-through mappings (`strategy_config`, `env.config`) are their backend's to check."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            key = FIELD_ALIASES.get(f.name, f.name)
            _check_numbers(getattr(node, f.name), f"{path}.{key}" if path else key)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_numbers(value, f"{path}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{path} must be a finite number, got {node}")
    elif isinstance(node, int) and not isinstance(node, bool) and not -INT64 <= node < INT64:
        raise ConfigError(f"{path}: {node} is out of range (a 64-bit integer)")


def _check_sizes(cfg: Config) -> None:
    for key in ("rollout_batch_size", "prompt_length", "response_length"):
        positive(key, getattr(cfg, key))
    positive("num_return_sequences_in_group", cfg.num_return_sequences_in_group)
    positive("max_steps", cfg.max_steps, allow_zero=True)
    if cfg.async_.max_staleness != "auto":  # auto: `async_checks.check_auto_staleness`
        positive("async.max_staleness", cfg.async_.max_staleness, allow_zero=True)
    positive("async.sync_interval", cfg.async_.sync_interval)
    positive("rollout.num_actors", cfg.rollout.num_actors)
    positive("rollout.max_inflight_prompts", cfg.rollout.max_inflight_prompts)
    positive("weight_sync.bucket_size_mb", cfg.weight_sync.bucket_size_mb)
    max_new = cfg.actor_infer.generating_args.max_new_tokens
    if max_new is not None and max_new > cfg.response_length:
        raise ConfigError(
            f"actor_infer.generating_args.max_new_tokens ({max_new}) exceeds response_length "
            f"({cfg.response_length})"
        )


def _check_loop(cfg: Config) -> None:
    """Seeds, ports, timeouts, intervals, output and resume: the run's plumbing."""
    positive("seed", cfg.seed, allow_zero=True)
    if not cfg.output_dir.strip():
        raise ConfigError("output_dir must name a directory, got an empty string")
    ro, ws = cfg.rollout, cfg.weight_sync
    port("rollout.transport_port", ro.transport_port)
    port("weight_sync.master_port", ws.master_port)
    for path, host in (("rollout.transport_host", ro.transport_host),
                       ("weight_sync.master_address", ws.master_address)):  # fmt: skip
        if not host.strip():
            raise ConfigError(f"{path} must name an address, got an empty string")
    positive("rollout.request_timeout_s", ro.request_timeout_s)
    positive("weight_sync.timeout_s", ws.timeout_s)
    positive("logging.eval_interval", cfg.logging.eval_interval, allow_zero=True)
    positive("logging.eval_size", cfg.logging.eval_size, allow_zero=True)
    _check_eval_engine(cfg)
    positive("actor.checkpoint.save_interval", cfg.actor.checkpoint.save_interval, allow_zero=True)
    _check_resume(cfg.actor.checkpoint.resume)


def _check_eval_engine(cfg: Config) -> None:
    """`logging.eval_engine: dedicated` takes the last engine from rollout: one must be left.
    `logging.eval_sync: pinned` needs engines that keep pinned versions (asyncrl's hf)."""
    infer, log = cfg.actor_infer, cfg.logging
    engine = infer.strategy_args.strategy_name
    if log.eval_sync == "pinned" and engine != "hf_infer":
        raise ConfigError(f"logging.eval_sync: pinned needs hf_infer engines (they keep a pinned "
                          f"version's weights); {engine} holds one version at a time: use wait")  # fmt: skip
    if log.eval_engine != "dedicated":
        return
    urls = infer.strategy_args.strategy_config.get("server_urls") or []  # attached servers
    engines = len(urls) or max(1, len(infer.device_mapping) // max(1, infer.num_gpus_per_worker))
    if engines < 2 or log.eval_interval == 0:
        why = f"actor_infer has {engines} engine" if engines < 2 else "logging.eval_interval is 0"
        raise ConfigError(f"logging.eval_engine: dedicated needs >= 2 engines and evaluation "
                          f"(eval_interval > 0), but {why}; use shared")  # fmt: skip


def _check_resume(resume: str) -> None:
    """never | auto | a checkpoint directory that exists now: a mistyped path would otherwise be
    found out only after the model is built (whether it holds a complete checkpoint is the
    checkpointer's to judge, when the run opens it)."""
    if resume in RESUME_MODES or Path(resume).is_dir():
        return
    raise ConfigError(
        f"actor.checkpoint.resume: {resume!r} is neither never, auto nor an existing "
        "checkpoint directory"
    )


def _check_reward(name: str) -> None:
    """A registered name, or a 'module:function' path that imports (the run would import it)."""
    from asyncrl.rewards.base import RewardError
    from asyncrl.rewards.registry import check_reward

    try:
        check_reward(name)
    except RewardError as e:
        raise ConfigError(f"rollout.reward_fn: {e}") from None


def _check_worker(role: str, worker: WorkerConfig) -> None:
    name = worker.strategy_args.strategy_name
    path = f"{role}.strategy_args.strategy_name"
    if name in REPLACED_STRATEGIES:
        raise ConfigError(f"{path}: {name} is not supported; use {REPLACED_STRATEGIES[name]}")
    one_of(path, name, STRATEGIES[role])
    data = worker.data_args
    if data.prompt is not None and data.messages is not None:
        raise ConfigError(
            f"{role}.data_args: set either prompt ({data.prompt!r}) or messages "
            f"({data.messages!r}), not both"
        )
    positive(f"{role}.infer_batch_size", worker.infer_batch_size)
    positive(f"{role}.num_gpus_per_worker", worker.num_gpus_per_worker)
    _check_training(f"{role}.training_args", worker.training_args)
    _check_sampling(f"{role}.generating_args", worker.generating_args)
    _check_devices(f"{role}.device_mapping", worker.device_mapping)
    _check_sections_read(role, worker)
    mix = worker.model_args.warm_start_mix
    if mix and (role != "actor_train" or worker.model_args.model_name_or_path):
        # The mix picks which embedded model is built; every other role follows actor_train's.
        raise ConfigError(
            f"{role}.model_args.warm_start_mix: mixes the embedded model's warm-start, so it is "
            "read on actor_train only and with an empty model_name_or_path"
        )
    if worker.model_args.dtype == "fp16" and name == "hf_infer":
        raise ConfigError(
            f"{role}.model_args.dtype: fp16 is not served by hf_infer (fp32 or bf16; SGLang "
            "serves fp16)"
        )
    if worker.model_args.dtype == "fp16" and name == "fsdp2_train" and role != "reference":
        # Pure fp16 weights under AdamW underflow (eps 1e-8 is 0 in fp16) and overflow without
        # loss scaling, which this learner does not do; Megatron scales the loss itself.
        raise ConfigError(
            f"{role}.model_args.dtype: fp16 training needs loss scaling, which fsdp2_train does "
            "not do; use bf16 or fp32 (or megatron_train)"
        )


# The sub-sections each role's worker reads (its sampling comes from actor_infer, its data from
# actor_train, and so on); a value set in any other one would be silently ignored.
SECTIONS_READ = {
    "actor_train": ("model_args", "training_args", "data_args", "strategy_args"),
    "actor_infer": ("model_args", "generating_args", "strategy_args"),
    "reference": ("model_args", "strategy_args"),
    "critic": ("model_args", "training_args", "strategy_args"),
}


def _check_sections_read(role: str, worker: WorkerConfig) -> None:
    defaults = WorkerConfig()
    for section in ("training_args", "data_args", "generating_args"):
        if section in SECTIONS_READ[role]:
            continue
        mine, default = getattr(worker, section), getattr(defaults, section)
        for f in dataclasses.fields(mine):
            if getattr(mine, f.name) != getattr(default, f.name):
                raise ConfigError(
                    f"{role}.{section}.{f.name}: not read for {role} (its worker reads "
                    f"{', '.join(SECTIONS_READ[role])})"
                )


def _check_training(path: str, targs: TrainingArgs) -> None:
    positive(f"{path}.per_device_train_batch_size", targs.per_device_train_batch_size)
    if targs.gradient_accumulation_steps is not None:
        positive(f"{path}.gradient_accumulation_steps", targs.gradient_accumulation_steps)
    positive(f"{path}.learning_rate", targs.learning_rate)
    positive(f"{path}.weight_decay", targs.weight_decay, allow_zero=True)
    positive(f"{path}.warmup_steps", targs.warmup_steps, allow_zero=True)
    positive(f"{path}.max_grad_norm", targs.max_grad_norm, allow_zero=True)


def _check_sampling(path: str, gen: GeneratingArgs) -> None:
    """SGLang's rules (`SamplingParams.verify`), with its greedy threshold made an error."""
    if gen.temperature != 0 and not gen.temperature >= MIN_TEMPERATURE:
        raise ConfigError(
            f"{path}.temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, "
            f"got {gen.temperature:g}"
        )
    if not 0 < gen.top_p <= 1:
        raise ConfigError(f"{path}.top_p must be in (0, 1], got {gen.top_p}")
    if gen.top_k != -1 and gen.top_k < 1:
        raise ConfigError(f"{path}.top_k must be -1 (off) or >= 1, got {gen.top_k}")
    if gen.max_new_tokens is not None:
        positive(f"{path}.max_new_tokens", gen.max_new_tokens)
    for i, token in enumerate(gen.stop_token_ids):
        positive(f"{path}.stop_token_ids[{i}]", token, allow_zero=True)


def _check_devices(path: str, devices: list[int]) -> None:
    # The loader bounds list(range(...)) before expanding it; a literal list is bounded here.
    if len(devices) > MAX_DEVICES:
        raise ConfigError(f"{path} lists {len(devices)} devices, more than {MAX_DEVICES}")
    bad = next((d for d in devices if not 0 <= d < MAX_DEVICES), None)
    if bad is not None:
        raise ConfigError(f"{path}: device id {bad} is not in 0..{MAX_DEVICES - 1}")
    if len(set(devices)) != len(devices):
        raise ConfigError(f"{path} lists a device twice: {devices}")


def _check_algorithm(cfg: Config) -> None:
    alg = cfg.algorithm
    one_of("algorithm.adv_estimator", alg.adv_estimator, ADV_ESTIMATORS)
    upper, lower = alg.rollout_is_threshold, alg.rollout_is_threshold_lower
    if upper is not None:
        positive("algorithm.rollout_is_threshold", upper)
        if lower is not None and not 0 < lower < upper:
            raise ConfigError(
                f"algorithm.rollout_is_threshold_lower ({lower}) must be in (0, "
                f"rollout_is_threshold={upper})"
            )
    veto = alg.rollout_is_veto_threshold
    if veto is not None and not 0 < veto < 1:
        raise ConfigError(f"algorithm.rollout_is_veto_threshold must be in (0, 1), got {veto}")
    for i, crit in enumerate(alg.rollout_rs):
        one_of(f"algorithm.rollout_rs[{i}].name", crit.name, RS_CRITERIA)
        if crit.lower is None and crit.upper is None:
            raise ConfigError(f"algorithm.rollout_rs[{i}] ({crit.name}) needs lower or upper")
    within("algorithm.gamma", alg.gamma, 0, 1)
    within("algorithm.lam", alg.lam, 0, 1)
    positive("algorithm.overlong_penalty_factor", alg.overlong_penalty_factor, allow_zero=True)
    positive("algorithm.overlong_buffer_len", alg.overlong_buffer_len, allow_zero=True)
    if alg.overlong_buffer_len >= cfg.response_length:
        raise ConfigError(
            f"algorithm.overlong_buffer_len ({alg.overlong_buffer_len}) must be below "
            f"response_length ({cfg.response_length})"
        )


def _check_actor(cfg: Config) -> None:
    actor = cfg.actor
    one_of("actor.policy_loss.loss_mode", actor.policy_loss.loss_mode, LOSS_MODES)
    one_of("actor.loss_agg_mode", actor.loss_agg_mode, LOSS_AGG_MODES)
    one_of("actor.kl_loss_type", actor.kl_loss_type, KL_TYPES)
    if actor.clip_ratio_c <= 1:
        raise ConfigError(f"actor.clip_ratio_c must be > 1, got {actor.clip_ratio_c}")
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        value = getattr(actor, key)
        if value is not None:
            positive(f"actor.{key}", value)
    positive("actor.ppo_epochs", actor.ppo_epochs)
    if actor.ppo_mini_batch_size is not None:
        positive("actor.ppo_mini_batch_size", actor.ppo_mini_batch_size)
    positive("actor.kl_loss_coef", actor.kl_loss_coef, allow_zero=True)
    _check_optim(cfg)
    ckpt = actor.checkpoint
    for key in ("save_contents", "load_contents"):
        for item in getattr(ckpt, key) or []:
            one_of(f"actor.checkpoint.{key}", item, CHECKPOINT_CONTENTS)
    if actor.policy_loss.loss_mode == "decoupled" and cfg.algorithm.correction_mode == "bypass":
        raise ConfigError(
            "actor.policy_loss.loss_mode: decoupled needs algorithm.correction_mode: decoupled "
            "(bypass has no proximal policy)"
        )


def _check_optim(cfg: Config) -> None:
    optim = cfg.actor.optim
    if len(optim.betas) != 2 or not all(0 <= b < 1 for b in optim.betas):
        raise ConfigError(f"actor.optim.betas must be two values in [0, 1), got {optim.betas}")
    positive("actor.optim.eps", optim.eps)
    within("actor.optim.min_lr_ratio", optim.min_lr_ratio, 0, 1)


def _check_env(cfg: Config) -> None:
    """Names are checked without importing the environment (a dotted path only by its form)."""
    from asyncrl.envs.registry import BUILTIN_ENVS, is_dotted_path

    env = cfg.env
    if not env.name:
        raise ConfigError(f"env.name: set one of {', '.join(sorted(BUILTIN_ENVS))} or a path")
    if env.name not in BUILTIN_ENVS and not is_dotted_path(env.name):
        raise ConfigError(
            f"env.name: {env.name!r} is not one of {', '.join(sorted(BUILTIN_ENVS))} "
            "nor a 'package.module:Class' path"
        )
    positive("env.max_turns", env.max_turns)
    positive("env.step_timeout_s", env.step_timeout_s)
    positive("env.num_seeds", env.num_seeds)
    positive("env.seed_offset", env.seed_offset, allow_zero=True)
    if env.max_tokens_per_turn is not None:
        positive("env.max_tokens_per_turn", env.max_tokens_per_turn)
    if not 0 <= env.gamma <= 1:
        raise ConfigError(f"env.gamma must be in [0, 1], got {env.gamma}")
    allowed = EPISODE_ESTIMATORS
    if env.advantage_mode == "trajectory":
        allowed += EPISODE_BATCH_ESTIMATORS
    one_of(
        f"algorithm.adv_estimator (with env, {env.advantage_mode})",
        cfg.algorithm.adv_estimator,
        allowed,
    )
    if cfg.algorithm.overlong_buffer_len:
        raise ConfigError("algorithm.overlong_buffer_len is not supported with env (set it to 0)")


def _check_unread(cfg: Config) -> None:
    """Values no backend honours yet: refused, never silently ignored."""
    if cfg.actor.use_kl_loss and cfg.actor.kl_loss_type == "full":
        raise ConfigError(
            "actor.kl_loss_type: full needs both policies' full-vocabulary logits, which the "
            "learners do not keep; use low_var_kl (k3), kl (k1), abs or mse (k2)"
        )
    train = cfg.actor_train
    if train.model_args.attn_implementation and train.strategy_args.strategy_name != "fsdp2_train":
        raise ConfigError(
            "actor_train.model_args.attn_implementation: only the fsdp2_train learner reads it "
            "(Megatron picks its kernels through strategy_config)"
        )
    for role in ("actor_infer", "reference", "critic"):
        worker = getattr(cfg, role)
        if worker is not None and worker.model_args.attn_implementation:
            raise ConfigError(
                f"{role}.model_args.attn_implementation: not read for {role} (the hf engine uses "
                "its own batched attention; SGLang takes attention_backend in strategy_config)"
            )

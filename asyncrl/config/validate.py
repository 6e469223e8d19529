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
    MAX_DEVICES,  # noqa: F401 - re-exported: the loader and tests read it here
    MIN_TEMPERATURE,  # noqa: F401 - re-exported (tests)
    RESUME_MODES,
    RS_CRITERIA,
    STRATEGIES,  # noqa: F401 - re-exported (the capability matrix)
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
)
from asyncrl.config.strategy_keys import check_strategy_keys
from asyncrl.config.verl_actor import check_actor as check_verl_actor
from asyncrl.config.worker_checks import check_worker


def validate(cfg: Config) -> None:
    _check_numbers(cfg, "")
    _check_sizes(cfg)
    _check_loop(cfg)
    check_cluster(cfg)
    for role in ("actor_train", "actor_infer", "reference", "critic"):
        worker = getattr(cfg, role)
        if worker is not None:
            check_worker(role, worker)
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

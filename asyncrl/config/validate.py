"""Cross-field checks that types alone cannot express. Each failure is one ConfigError line."""

from __future__ import annotations

from asyncrl.config.schema import Config, ConfigError, WorkerConfig

# Names accepted by the algorithm registries (asyncrl.algo); a test keeps these lists equal to
# the registries so the config can be validated without importing torch.
LOSS_MODES = ("vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "decoupled")
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")
ADV_ESTIMATORS = (
    "grpo",
    "drgrpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "gae",
)
RS_CRITERIA = tuple(
    [f"token_k{k}" for k in (1, 2, 3)]
    + [f"seq_sum_k{k}" for k in (1, 2, 3)]
    + [f"seq_mean_k{k}" for k in (1, 2, 3)]
    + ["seq_max_k2", "seq_max_k3"]
)
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")
# Estimators an env run computes in the rollout worker (asyncrl.algo.episode keeps them equal).
EPISODE_ESTIMATORS = ("grpo", "drgrpo", "rloo")

# Strategy names per role; removed backends map to the error that names their replacement.
STRATEGIES = {
    "actor_train": ("fsdp2_train", "megatron_train"),
    "critic": ("fsdp2_train", "megatron_train"),
    "actor_infer": ("sglang", "hf_infer"),
    "reference": ("fsdp2_train", "megatron_infer", "hf_infer"),
}
REPLACED_STRATEGIES = {
    "deepspeed_train": "fsdp2_train (the plain-PyTorch learner takes DeepSpeed's place)",
    "deepspeed_infer": "fsdp2_train or megatron_infer",
    "vllm": "sglang (or hf_infer on a CPU box)",
}


def validate(cfg: Config) -> None:
    _check_sizes(cfg)
    for role in ("actor_train", "actor_infer", "reference", "critic"):
        worker = getattr(cfg, role)
        if worker is not None:
            _check_worker(role, worker)
    _check_algorithm(cfg)
    _check_actor(cfg)
    if cfg.env is not None:
        _check_env(cfg)


def _positive(path: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{path} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _one_of(path: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{path}: {value!r} is not one of {', '.join(allowed)}")


def _check_sizes(cfg: Config) -> None:
    for key in ("rollout_batch_size", "prompt_length", "response_length"):
        _positive(key, getattr(cfg, key))
    _positive("num_return_sequences_in_group", cfg.num_return_sequences_in_group)
    _positive("max_steps", cfg.max_steps, allow_zero=True)
    _positive("async.max_staleness", cfg.async_.max_staleness, allow_zero=True)
    _positive("async.sync_interval", cfg.async_.sync_interval)
    _positive("rollout.num_actors", cfg.rollout.num_actors)
    _positive("rollout.max_inflight_prompts", cfg.rollout.max_inflight_prompts)
    _positive("weight_sync.bucket_size_mb", cfg.weight_sync.bucket_size_mb)
    _positive("weight_sync.timeout_s", cfg.weight_sync.timeout_s)
    max_new = cfg.actor_infer.generating_args.max_new_tokens
    if max_new is not None and max_new > cfg.response_length:
        raise ConfigError(
            f"actor_infer.generating_args.max_new_tokens ({max_new}) exceeds response_length "
            f"({cfg.response_length})"
        )


def _check_worker(role: str, worker: WorkerConfig) -> None:
    name = worker.strategy_args.strategy_name
    path = f"{role}.strategy_args.strategy_name"
    if name in REPLACED_STRATEGIES:
        raise ConfigError(f"{path}: {name} is not supported; use {REPLACED_STRATEGIES[name]}")
    _one_of(path, name, STRATEGIES[role])
    data = worker.data_args
    if data.prompt is not None and data.messages is not None:
        raise ConfigError(
            f"{role}.data_args: set either prompt ({data.prompt!r}) or messages "
            f"({data.messages!r}), not both"
        )
    _positive(f"{role}.infer_batch_size", worker.infer_batch_size)
    _positive(f"{role}.num_gpus_per_worker", worker.num_gpus_per_worker)
    targs = worker.training_args
    _positive(
        f"{role}.training_args.per_device_train_batch_size", targs.per_device_train_batch_size
    )
    if targs.gradient_accumulation_steps is not None:
        _positive(
            f"{role}.training_args.gradient_accumulation_steps", targs.gradient_accumulation_steps
        )
    _positive(f"{role}.training_args.learning_rate", targs.learning_rate, allow_zero=True)
    gen = worker.generating_args
    _positive(f"{role}.generating_args.temperature", gen.temperature, allow_zero=True)
    if not 0 < gen.top_p <= 1:
        raise ConfigError(f"{role}.generating_args.top_p must be in (0, 1], got {gen.top_p}")
    if len(set(worker.device_mapping)) != len(worker.device_mapping):
        raise ConfigError(f"{role}.device_mapping lists a device twice: {worker.device_mapping}")


def _check_algorithm(cfg: Config) -> None:
    alg = cfg.algorithm
    _one_of("algorithm.adv_estimator", alg.adv_estimator, ADV_ESTIMATORS)
    if alg.adv_estimator == "gae" and cfg.critic is None:
        raise ConfigError("algorithm.adv_estimator: gae needs a critic section")
    upper, lower = alg.rollout_is_threshold, alg.rollout_is_threshold_lower
    if upper is not None:
        _positive("algorithm.rollout_is_threshold", upper)
        if lower is not None and not 0 < lower < upper:
            raise ConfigError(
                f"algorithm.rollout_is_threshold_lower ({lower}) must be in (0, "
                f"rollout_is_threshold={upper})"
            )
    veto = alg.rollout_is_veto_threshold
    if veto is not None and not 0 < veto < 1:
        raise ConfigError(f"algorithm.rollout_is_veto_threshold must be in (0, 1), got {veto}")
    for i, crit in enumerate(alg.rollout_rs):
        _one_of(f"algorithm.rollout_rs[{i}].name", crit.name, RS_CRITERIA)
        if crit.lower is None and crit.upper is None:
            raise ConfigError(f"algorithm.rollout_rs[{i}] ({crit.name}) needs lower or upper")
    _positive("algorithm.overlong_buffer_len", alg.overlong_buffer_len, allow_zero=True)
    if alg.overlong_buffer_len >= cfg.response_length:
        raise ConfigError(
            f"algorithm.overlong_buffer_len ({alg.overlong_buffer_len}) must be below "
            f"response_length ({cfg.response_length})"
        )


def _check_actor(cfg: Config) -> None:
    actor = cfg.actor
    _one_of("actor.policy_loss.loss_mode", actor.policy_loss.loss_mode, LOSS_MODES)
    _one_of("actor.loss_agg_mode", actor.loss_agg_mode, LOSS_AGG_MODES)
    _one_of("actor.kl_loss_type", actor.kl_loss_type, KL_TYPES)
    if actor.clip_ratio_c <= 1:
        raise ConfigError(f"actor.clip_ratio_c must be > 1, got {actor.clip_ratio_c}")
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        value = getattr(actor, key)
        if value is not None:
            _positive(f"actor.{key}", value)
    _positive("actor.ppo_epochs", actor.ppo_epochs)
    if actor.ppo_mini_batch_size is not None:
        _positive("actor.ppo_mini_batch_size", actor.ppo_mini_batch_size)
    ckpt = actor.checkpoint
    for key in ("save_contents", "load_contents"):
        for item in getattr(ckpt, key) or []:
            _one_of(f"actor.checkpoint.{key}", item, CHECKPOINT_CONTENTS)
    if actor.policy_loss.loss_mode == "decoupled" and cfg.algorithm.correction_mode == "bypass":
        raise ConfigError(
            "actor.policy_loss.loss_mode: decoupled needs algorithm.correction_mode: decoupled "
            "(bypass has no proximal policy)"
        )


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
    _positive("env.max_turns", env.max_turns)
    _positive("env.step_timeout_s", env.step_timeout_s)
    _positive("env.num_seeds", env.num_seeds)
    if env.max_tokens_per_turn is not None:
        _positive("env.max_tokens_per_turn", env.max_tokens_per_turn)
    if not 0 <= env.gamma <= 1:
        raise ConfigError(f"env.gamma must be in [0, 1], got {env.gamma}")
    _one_of("algorithm.adv_estimator (with env)", cfg.algorithm.adv_estimator, EPISODE_ESTIMATORS)
    if cfg.algorithm.overlong_buffer_len:
        raise ConfigError("algorithm.overlong_buffer_len is not supported with env (set it to 0)")

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

from asyncrl.config.schema import (
    FIELD_ALIASES,
    Config,
    ConfigError,
    GeneratingArgs,
    ModelArgs,
    TrainingArgs,
    WorkerConfig,
)

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
# Estimators an env run computes in the rollout worker (asyncrl.algo.episode keeps them equal);
# the batch-level ones (the learner's) work on episode returns in trajectory mode.
EPISODE_ESTIMATORS = ("grpo", "drgrpo", "rloo")
EPISODE_BATCH_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")

PORT_MAX = 65535
# Most devices one worker section may list, and the bound of a device id: far above any real
# cluster, low enough that a typo like list(range(0, 10**9)) fails before it allocates.
MAX_DEVICES = 65536
INT64 = 2**63
# SGLang's rule (SamplingParams: `_SAMPLING_EPS = 1e-6`): a temperature in [0, 1e-6) samples
# greedily. A positive temperature below it is refused rather than silently made greedy: the
# learner divides its logits by the configured value, and by 1e-40 they overflow to inf.
MIN_TEMPERATURE = 1e-6
RESUME_MODES = ("never", "auto")

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
    _check_numbers(cfg, "")
    _check_sizes(cfg)
    _check_loop(cfg)
    for role in ("actor_train", "actor_infer", "reference", "critic"):
        worker = getattr(cfg, role)
        if worker is not None:
            _check_worker(role, worker)
    _check_algorithm(cfg)
    _check_stale_policy(cfg)
    _check_critic(cfg)
    _check_kl_in_reward(cfg)
    _check_actor(cfg)
    _check_reference(cfg)
    _check_parallel_sizes(cfg)
    _check_unread(cfg)
    _check_lora(cfg)
    if cfg.env is not None:
        _check_env(cfg)
    _check_reward(cfg.rollout.reward_fn)


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


def _positive(path: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{path} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _within(path: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{path} must be in [{low:g}, {high:g}], got {value}")


def _port(path: str, value: int) -> None:
    if not 0 <= value <= PORT_MAX:
        raise ConfigError(
            f"{path} must be a TCP port 0..{PORT_MAX} (0 picks a free one), got {value}"
        )


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
    max_new = cfg.actor_infer.generating_args.max_new_tokens
    if max_new is not None and max_new > cfg.response_length:
        raise ConfigError(
            f"actor_infer.generating_args.max_new_tokens ({max_new}) exceeds response_length "
            f"({cfg.response_length})"
        )


def _check_loop(cfg: Config) -> None:
    """Seeds, ports, timeouts, intervals, output and resume: the run's plumbing."""
    _positive("seed", cfg.seed, allow_zero=True)
    if not cfg.output_dir.strip():
        raise ConfigError("output_dir must name a directory, got an empty string")
    ro, ws = cfg.rollout, cfg.weight_sync
    _port("rollout.transport_port", ro.transport_port)
    _port("weight_sync.master_port", ws.master_port)
    for path, host in (("rollout.transport_host", ro.transport_host),
                       ("weight_sync.master_address", ws.master_address)):  # fmt: skip
        if not host.strip():
            raise ConfigError(f"{path} must name an address, got an empty string")
    _positive("rollout.request_timeout_s", ro.request_timeout_s)
    _positive("weight_sync.timeout_s", ws.timeout_s)
    _positive("logging.eval_interval", cfg.logging.eval_interval, allow_zero=True)
    _positive("logging.eval_size", cfg.logging.eval_size, allow_zero=True)
    _positive("actor.checkpoint.save_interval", cfg.actor.checkpoint.save_interval, allow_zero=True)
    _check_resume(cfg.actor.checkpoint.resume)


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
    _one_of(path, name, STRATEGIES[role])
    data = worker.data_args
    if data.prompt is not None and data.messages is not None:
        raise ConfigError(
            f"{role}.data_args: set either prompt ({data.prompt!r}) or messages "
            f"({data.messages!r}), not both"
        )
    _positive(f"{role}.infer_batch_size", worker.infer_batch_size)
    _positive(f"{role}.num_gpus_per_worker", worker.num_gpus_per_worker)
    _check_training(f"{role}.training_args", worker.training_args)
    _check_sampling(f"{role}.generating_args", worker.generating_args)
    _check_devices(f"{role}.device_mapping", worker.device_mapping)
    _check_sections_read(role, worker)
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
    _positive(f"{path}.per_device_train_batch_size", targs.per_device_train_batch_size)
    if targs.gradient_accumulation_steps is not None:
        _positive(f"{path}.gradient_accumulation_steps", targs.gradient_accumulation_steps)
    _positive(f"{path}.learning_rate", targs.learning_rate)
    _positive(f"{path}.weight_decay", targs.weight_decay, allow_zero=True)
    _positive(f"{path}.warmup_steps", targs.warmup_steps, allow_zero=True)
    _positive(f"{path}.max_grad_norm", targs.max_grad_norm, allow_zero=True)


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
        _positive(f"{path}.max_new_tokens", gen.max_new_tokens)
    for i, token in enumerate(gen.stop_token_ids):
        _positive(f"{path}.stop_token_ids[{i}]", token, allow_zero=True)


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
    _one_of("algorithm.adv_estimator", alg.adv_estimator, ADV_ESTIMATORS)
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
    _within("algorithm.gamma", alg.gamma, 0, 1)
    _within("algorithm.lam", alg.lam, 0, 1)
    _positive("algorithm.overlong_penalty_factor", alg.overlong_penalty_factor, allow_zero=True)
    _positive("algorithm.overlong_buffer_len", alg.overlong_buffer_len, allow_zero=True)
    if alg.overlong_buffer_len >= cfg.response_length:
        raise ConfigError(
            f"algorithm.overlong_buffer_len ({alg.overlong_buffer_len}) must be below "
            f"response_length ({cfg.response_length})"
        )


def _check_stale_policy(cfg: Config) -> None:
    """`stale_policy: correct` trains groups past max_staleness, sound only when the learner's
    rollout IS reweights them by pi_prox / pi_behaviour (`learner/objective.py:correct`) per
    sequence (or geometric mean), vetoing catastrophic ratios: a token-level weight leaves the
    product of a long stale response's ratios uncorrected."""
    a, alg = cfg.async_, cfg.algorithm
    _positive("async.max_staleness_hard", a.max_staleness_hard, allow_zero=True)
    if a.stale_policy != "correct":
        return
    if a.max_staleness_hard < a.max_staleness:
        raise ConfigError(
            f"async.max_staleness_hard ({a.max_staleness_hard}) must be >= async.max_staleness "
            f"({a.max_staleness}) with stale_policy correct"
        )
    problems = [
        what
        for bad, what in (
            (alg.correction_mode == "bypass", "algorithm.correction_mode must not be bypass"),
            (alg.rollout_is_threshold is None, "algorithm.rollout_is_threshold must be set"),
            (not alg.rollout_is, "algorithm.rollout_is must be true"),
            (alg.rollout_is_level == "token", "algorithm.rollout_is_level: sequence|geometric"),
            (alg.rollout_is_veto_threshold is None, "algorithm.rollout_is_veto_threshold: set"),
        )
        if bad
    ]
    if problems:
        raise ConfigError(
            "async.stale_policy correct trains groups past max_staleness with rollout IS, "
            f"which this config does not apply: {'; '.join(problems)}"
        )


def _check_critic(cfg: Config) -> None:
    """The critic runs inside the fsdp2_train learner, on its one device; only gae reads its
    values, so a critic with another estimator (verl would train it unread) is refused."""
    critic, alg, train = cfg.critic, cfg.algorithm, cfg.actor_train
    _positive("algorithm.cliprange_value", alg.cliprange_value)
    _positive("algorithm.critic_warmup", alg.critic_warmup, allow_zero=True)
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
    _one_device("critic", train)


def _one_device(what: str, train: WorkerConfig) -> None:
    if len(train.device_mapping) > 1:
        raise ConfigError(
            f"{what} with a data-parallel actor_train ({len(train.device_mapping)} devices) is "
            "not available yet: use one device"
        )


def _check_kl_in_reward(cfg: Config) -> None:
    """verl's use_kl_in_reward penalises token rewards before a learner-side estimator."""
    alg, ctrl = cfg.algorithm, cfg.algorithm.kl_ctrl
    _one_of("algorithm.kl_penalty", alg.kl_penalty, tuple(k for k in KL_TYPES if k != "full"))
    _positive("algorithm.kl_ctrl.kl_coef", ctrl.kl_coef, allow_zero=True)
    _positive("algorithm.kl_ctrl.target_kl", ctrl.target_kl)
    _positive("algorithm.kl_ctrl.horizon", ctrl.horizon)
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
    _one_device("algorithm.use_kl_in_reward", cfg.actor_train)


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
    _positive("actor.kl_loss_coef", actor.kl_loss_coef, allow_zero=True)
    _check_optim(cfg)
    ckpt = actor.checkpoint
    for key in ("save_contents", "load_contents"):
        for item in getattr(ckpt, key) or []:
            _one_of(f"actor.checkpoint.{key}", item, CHECKPOINT_CONTENTS)
    if actor.policy_loss.loss_mode == "decoupled" and cfg.algorithm.correction_mode == "bypass":
        raise ConfigError(
            "actor.policy_loss.loss_mode: decoupled needs algorithm.correction_mode: decoupled "
            "(bypass has no proximal policy)"
        )


def _check_optim(cfg: Config) -> None:
    optim = cfg.actor.optim
    if len(optim.betas) != 2 or not all(0 <= b < 1 for b in optim.betas):
        raise ConfigError(f"actor.optim.betas must be two values in [0, 1), got {optim.betas}")
    _positive("actor.optim.eps", optim.eps)
    _within("actor.optim.min_lr_ratio", optim.min_lr_ratio, 0, 1)


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
    _positive("env.seed_offset", env.seed_offset, allow_zero=True)
    if env.max_tokens_per_turn is not None:
        _positive("env.max_tokens_per_turn", env.max_tokens_per_turn)
    if not 0 <= env.gamma <= 1:
        raise ConfigError(f"env.gamma must be in [0, 1], got {env.gamma}")
    allowed = EPISODE_ESTIMATORS
    if env.advantage_mode == "trajectory":
        allowed += EPISODE_BATCH_ESTIMATORS
    _one_of(
        f"algorithm.adv_estimator (with env, {env.advantage_mode})",
        cfg.algorithm.adv_estimator,
        allowed,
    )
    if cfg.algorithm.overlong_buffer_len:
        raise ConfigError("algorithm.overlong_buffer_len is not supported with env (set it to 0)")


def _check_reference(cfg: Config) -> None:
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
    if cfg.actor_train.strategy_args.strategy_name == "megatron_train":
        dtype = cfg.actor_train.model_args.dtype or "bf16"
        if ref.model_args.dtype not in (None, dtype):
            raise ConfigError(
                f"reference.model_args.dtype {ref.model_args.dtype} with megatron_train: the "
                f"reference is built in actor_train's dtype ({dtype}); leave it null or set {dtype}"
            )


MEGATRON_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "virtual_pipeline_model_parallel_size", "context_parallel_size")  # fmt: skip


def _check_parallel_sizes(cfg: Config) -> None:
    """Megatron's model-parallel sizes (TP, PP, VPP, CP) a run can honour. The learner checks
    the rest of strategy_config, and what needs the model's config.json (layers per virtual
    stage), when it is built (`asyncrl.learner.megatron.args`)."""
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


LORA_FIELDS = (
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "lora_target_exclude",
    "use_rslora",
)


def _check_lora(cfg: Config) -> None:
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
    _positive(f"{path}.lora_alpha", args.lora_alpha)
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
            f"weight_sync.lora_sync: adapter needs hf_infer engines; with {infer} use merge "
            "(or auto), which syncs full weights with the adapter merged in"
        )

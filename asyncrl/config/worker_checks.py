"""Checks of one role's worker section (`actor_train`, `actor_infer`, `reference`, `critic`):
its strategy name, data source, sizes, training arguments, SGLang's sampling rules, device
ids, the sub-sections the role reads, and the dtypes its strategy can hold. Each failure is one
ConfigError line naming the key (`validate.py` runs them per role)."""

from __future__ import annotations

import dataclasses

from asyncrl.config.rules import (
    MAX_DEVICES,
    MIN_TEMPERATURE,
    REPLACED_STRATEGIES,
    STRATEGIES,
    one_of,
    positive,
)
from asyncrl.config.schema import ConfigError, GeneratingArgs, TrainingArgs, WorkerConfig


def check_worker(role: str, worker: WorkerConfig) -> None:
    """A role's worker section: its strategy, data, sizes, training, sampling, devices, the
    sub-sections it reads, and the dtypes its strategy can hold."""
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

"""The derived batch plan: how a rollout turns into optimizer steps, counted as the learners do.

One rule sizes an optimizer step, for every learner and for the plan (`step_size`):
- `actor.ppo_mini_batch_size` sequences (verl), or
- ROLL's global train batch, `per_device_train_batch_size × gradient_accumulation_steps ×
  data-parallel ranks` sequences, when `gradient_accumulation_steps` is given (the two given
  and different is an error), or
- the whole rollout (rollout_batch_size × num_return_sequences_in_group): one step.
Data-parallel ranks: the world size for data-parallel strategies (fsdp2_train); world / (tp ·
pp · cp) for Megatron (expert parallelism does not divide it: EP ranks share data-parallel
replicas). Each epoch walks the rollout in `mini_batches`, one optimizer (and scheduler) step
each; `ppo_epochs` epochs. So the learners' step count is set by the config, not the data:
micro-batching (`per_device_train_batch_size` rows, or `use_dynamic_bsz` token-packed passes)
only splits a step's forward/backward passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from asyncrl.config.schema import ActorConfig, Config, ConfigError, TrainingArgs


@dataclass
class BatchPlan:
    sequences_per_rollout: int
    """rollout_batch_size × num_return_sequences_in_group."""
    world_size: int
    """Training processes (len(actor_train.device_mapping), 1 on a CPU box)."""
    model_parallel: int
    """tp · pp · cp for Megatron, 1 for data-parallel strategies."""
    data_parallel: int
    """world_size / model_parallel."""
    per_device_train_batch_size: int
    """Sequences per micro-batch per data-parallel rank."""
    global_train_batch_size: int
    """Sequences per optimizer step (`step_size`, at most the rollout's)."""
    gradient_accumulation_steps: int | None
    """Micro-batches per data-parallel rank per optimizer step (the most any rank runs); None
    with use_dynamic_bsz, whose micro-batches are packed by tokens."""
    derived_gradient_accumulation_steps: int
    """The accumulation that gives exactly one optimizer step per rollout (ROLL's formula)."""
    ppo_epochs: int
    """Passes over each rollout."""
    optimizer_steps_per_rollout: int
    """ppo_epochs × mini-batches per epoch: the actor's optimizer and scheduler steps."""
    critic_warmup_rollouts: int
    """Rollouts that train the critic only (algorithm.critic_warmup with a critic, else 0)."""
    actor_optimizer_steps: int
    """The actor's optimizer steps over the run: (max_steps − critic warm-up) × per rollout."""
    schedule_horizon: int
    """The learning-rate schedule's length in optimizer steps: actor.optim.total_training_steps
    when > 0, else actor_optimizer_steps."""
    warmup_rollouts: float
    """training_args.warmup_steps in rollouts (warm-up steps / optimizer steps per rollout)."""
    critic_optimizer_steps_per_rollout: int | None
    """The critic's steps per rollout (its own micro-batch and accumulation); None: no critic."""
    num_engines: int
    """Rollout engines (len(actor_infer.device_mapping) / num_gpus_per_worker, ≥ 1)."""
    warnings: list[str] = field(default_factory=list)
    """Sizes that do not divide evenly."""


def step_size(
    actor: ActorConfig, targs: TrainingArgs, data_parallel: int, role: str = "actor_train"
) -> int | None:
    """Sequences per optimizer step (module docstring) of the role whose `training_args` are
    `targs`; None: the whole rollout. ValueError (one line) where the config contradicts
    itself: ppo_mini_batch_size and ROLL's global batch disagree, or an accumulation count
    with use_dynamic_bsz."""
    accumulation = targs.gradient_accumulation_steps
    if accumulation is None:
        return actor.ppo_mini_batch_size
    key = f"{role}.training_args.gradient_accumulation_steps"
    if actor.use_dynamic_bsz:
        raise ValueError(
            f"{key}: with actor.use_dynamic_bsz micro-batches are packed by tokens, so a count "
            "of micro-batches does not size a step; set actor.ppo_mini_batch_size (sequences "
            "per optimizer step) instead"
        )
    per_device = targs.per_device_train_batch_size
    roll = per_device * accumulation * data_parallel
    if actor.ppo_mini_batch_size is not None and actor.ppo_mini_batch_size != roll:
        raise ValueError(
            f"{key}: {accumulation} × per_device_train_batch_size {per_device} × "
            f"{data_parallel} data-parallel ranks = {roll} sequences per optimizer step, but "
            f"actor.ppo_mini_batch_size is {actor.ppo_mini_batch_size}; they size the same "
            "step: set one"
        )
    return roll


def mini_batches(rows: int, size: int | None) -> list[range]:
    """The rows of each optimizer step of one epoch, in the epoch's order: consecutive runs of
    `size` (None: all `rows`); the last is shorter when `size` does not divide `rows`."""
    size = size or rows
    return [range(start, min(start + size, rows)) for start in range(0, rows, max(1, size))]


def optimizer_steps(rows: int, size: int | None, ppo_epochs: int) -> int:
    """Optimizer steps of one rollout of `rows` sequences: ppo_epochs × `mini_batches`."""
    return ppo_epochs * len(mini_batches(rows, size))


def _megatron_parallel(strategy_config: dict) -> int:
    mp = 1
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "context_parallel_size"):  # fmt: skip
        mp *= int(strategy_config.get(key, 1) or 1)
    return mp


def _step(cfg: Config, targs: TrainingArgs, dp: int, role: str, seqs: int) -> int | None:
    """`step_size`, refused where it contradicts itself or where ROLL's global batch holds
    more than a rollout: its micro-batch count could not be honoured (a larger
    ppo_mini_batch_size, verl's default block's 256 among them, is one step: a warning)."""
    try:
        size = step_size(cfg.actor, targs, dp, role)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    accumulation = targs.gradient_accumulation_steps
    if accumulation is not None and size is not None and size > seqs:
        most = max(1, seqs // (targs.per_device_train_batch_size * dp))
        raise ConfigError(
            f"{role}.training_args.gradient_accumulation_steps: {accumulation} micro-batches "
            f"make a global batch of {size} sequences, more than the rollout's {seqs} "
            f"(rollout_batch_size × num_return_sequences_in_group); at most {most} here"
        )
    return size


def derive_plan(cfg: Config) -> BatchPlan:
    """The plan of `cfg`; ConfigError where the step's size is contradictory."""
    train = cfg.actor_train
    targs = train.training_args
    world = max(1, len(train.device_mapping))
    warnings: list[str] = []
    mp = 1
    if train.strategy_args.strategy_name == "megatron_train":
        mp = _megatron_parallel(train.strategy_args.strategy_config)
        if world % mp:
            warnings.append(f"actor_train world size {world} is not divisible by tp·pp·cp = {mp}")
    dp = max(1, world // mp)
    seqs = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
    per_dev = targs.per_device_train_batch_size
    derived = max(1, math.ceil(seqs / (per_dev * dp)))
    if seqs > per_dev * dp and seqs % (per_dev * dp):  # uneven micro-batches
        warnings.append(
            f"rollout sequences ({seqs}) are not divisible by per_device_train_batch_size × "
            f"data parallel ({per_dev} × {dp})"
        )
    size = _step(cfg, targs, dp, "actor_train", seqs)
    warnings += _size_warnings(seqs, size)
    steps = optimizer_steps(seqs, size, cfg.actor.ppo_epochs)
    global_bs = min(size or seqs, seqs)
    accum = None if cfg.actor.use_dynamic_bsz else math.ceil(math.ceil(global_bs / dp) / per_dev)
    warm = cfg.algorithm.critic_warmup if cfg.critic is not None else 0
    actor_steps = max(0, cfg.max_steps - warm) * steps
    horizon = cfg.actor.optim.total_training_steps
    return BatchPlan(
        sequences_per_rollout=seqs,
        world_size=world,
        model_parallel=mp,
        data_parallel=dp,
        per_device_train_batch_size=per_dev,
        global_train_batch_size=global_bs,
        gradient_accumulation_steps=accum,
        derived_gradient_accumulation_steps=derived,
        ppo_epochs=cfg.actor.ppo_epochs,
        optimizer_steps_per_rollout=steps,
        critic_warmup_rollouts=warm,
        actor_optimizer_steps=actor_steps,
        schedule_horizon=horizon if horizon is not None and horizon > 0 else actor_steps,
        warmup_rollouts=targs.warmup_steps / steps if steps else 0.0,
        critic_optimizer_steps_per_rollout=_critic_steps(cfg, seqs, dp),
        num_engines=_engines(cfg, warnings),
        warnings=warnings,
    )


def _critic_steps(cfg: Config, seqs: int, dp: int) -> int | None:
    """The critic's steps per rollout: the actor's epochs and step rule over its own
    training_args (it trains on the learner's ranks)."""
    if cfg.critic is None:
        return None
    size = _step(cfg, cfg.critic.training_args, dp, "critic", seqs)
    return optimizer_steps(seqs, size, cfg.actor.ppo_epochs)


def _size_warnings(seqs: int, size: int | None) -> list[str]:
    if size is None or size == seqs:
        return []
    if size > seqs:
        return [
            f"{size} sequences per optimizer step exceed the rollout's {seqs}: one step per "
            "epoch over the whole rollout"
        ]
    if seqs % size:
        return [
            f"{size} sequences per optimizer step do not divide the rollout's {seqs}: each "
            f"epoch's last step trains on {seqs % size}"
        ]
    return []


def _engines(cfg: Config, warnings: list[str]) -> int:
    infer = cfg.actor_infer
    engines = max(1, len(infer.device_mapping) // infer.num_gpus_per_worker)
    if infer.device_mapping and len(infer.device_mapping) % infer.num_gpus_per_worker:
        warnings.append(
            f"actor_infer has {len(infer.device_mapping)} devices, not a multiple of "
            f"num_gpus_per_worker={infer.num_gpus_per_worker}"
        )
    return engines


def schedule_record(plan: BatchPlan) -> dict[str, int | None]:
    """What a checkpoint keeps of the plan (its run state), so a resume can tell whether its
    schedules' positions still fit this config's (`check_resumed_plan`)."""
    return {
        "optimizer_steps_per_rollout": plan.optimizer_steps_per_rollout,
        "critic_warmup_rollouts": plan.critic_warmup_rollouts,
        "critic_optimizer_steps_per_rollout": plan.critic_optimizer_steps_per_rollout,
    }


def check_resumed_plan(saved: dict[str, int | None] | None, cfg: Config) -> None:
    """Refuse (one line) to resume a run whose decaying schedule was sized for another step
    plan: its position (the steps taken so far) and this config's horizon would not meet at
    max_steps. Constant schedules and a fixed total_training_steps do not depend on it; a
    checkpoint without the record (older) is taken as it is."""
    if saved is None or cfg.actor.optim.total_training_steps:
        return
    now = schedule_record(derive_plan(cfg))
    decays = [cfg.actor_train.training_args.lr_scheduler_type != "constant"]
    if cfg.critic is not None:
        decays.append(cfg.critic.training_args.lr_scheduler_type != "constant")
    changed = [k for k, v in now.items() if saved.get(k, v) != v]
    if changed and any(decays):
        diffs = ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in changed)
        raise ConfigError(
            f"resume: the checkpoint's run planned {diffs} (actor.ppo_epochs, "
            "ppo_mini_batch_size, gradient_accumulation_steps, critic_warmup): its decaying "
            "learning-rate schedule would not end at max_steps; resume with the run's batch "
            "plan, or set actor.optim.total_training_steps"
        )

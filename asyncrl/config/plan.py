"""The derived batch plan: how a rollout turns into optimizer steps (ROLL's formulas).

Data-parallel strategies (fsdp2_train): global batch = per_device × accumulation × world.
Megatron: global batch = per_device × accumulation × world / (tp · pp · cp) — expert
parallelism does not divide it, because EP ranks share data-parallel replicas.
One optimizer step per rollout needs
    accumulation = rollout_batch_size · n · tp · pp · cp / per_device / world.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.config.schema import Config


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
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step (configured, or derived for one step per rollout)."""
    derived_gradient_accumulation_steps: int
    """The accumulation that gives exactly one optimizer step per rollout."""
    global_train_batch_size: int
    """Sequences per optimizer step."""
    optimizer_steps_per_rollout: float
    """sequences_per_rollout / global_train_batch_size (per PPO epoch)."""
    num_engines: int
    """Rollout engines (len(actor_infer.device_mapping) / num_gpus_per_worker, ≥ 1)."""
    warnings: list[str] = field(default_factory=list)
    """Sizes that do not divide evenly."""


def _megatron_parallel(strategy_config: dict) -> tuple[int, list[str]]:
    sizes = {
        k: int(strategy_config.get(k, 1) or 1)
        for k in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
        )
    }
    mp = 1
    for v in sizes.values():
        mp *= v
    return mp, [f"{k}={v}" for k, v in sizes.items() if v > 1]


def derive_plan(cfg: Config) -> BatchPlan:
    train = cfg.actor_train
    targs = train.training_args
    world = max(1, len(train.device_mapping))
    warnings: list[str] = []
    mp = 1
    if train.strategy_args.strategy_name == "megatron_train":
        mp, _ = _megatron_parallel(train.strategy_args.strategy_config)
        if world % mp:
            warnings.append(f"actor_train world size {world} is not divisible by tp·pp·cp = {mp}")
    dp = max(1, world // mp)
    seqs = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
    per_dev = targs.per_device_train_batch_size
    derived_num, derived_den = seqs * mp, per_dev * world
    derived = max(1, derived_num // derived_den)
    if derived_num % derived_den:
        warnings.append(
            f"rollout sequences ({seqs}) are not divisible by per_device_train_batch_size × "
            f"data parallel ({per_dev} × {dp}); one step per rollout is not exact"
        )
    accum = targs.gradient_accumulation_steps or derived
    global_bs = per_dev * accum * world // mp
    if seqs % global_bs:
        warnings.append(
            f"global train batch size {global_bs} does not divide the rollout's {seqs} sequences"
        )
    infer = cfg.actor_infer
    engines = max(1, len(infer.device_mapping) // infer.num_gpus_per_worker)
    if infer.device_mapping and len(infer.device_mapping) % infer.num_gpus_per_worker:
        warnings.append(
            f"actor_infer has {len(infer.device_mapping)} devices, not a multiple of "
            f"num_gpus_per_worker={infer.num_gpus_per_worker}"
        )
    return BatchPlan(
        sequences_per_rollout=seqs,
        world_size=world,
        model_parallel=mp,
        data_parallel=dp,
        per_device_train_batch_size=per_dev,
        gradient_accumulation_steps=accum,
        derived_gradient_accumulation_steps=derived,
        global_train_batch_size=global_bs,
        optimizer_steps_per_rollout=seqs / global_bs,
        num_engines=engines,
        warnings=warnings,
    )

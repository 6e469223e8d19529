"""Build the torch learner's critic from the `critic:` section (see `asyncrl.learner.critic`),
sharded with FSDP2 like the actor when the learner has > 1 rank, and its sharded checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncrl.config.plan import step_size
from asyncrl.config.schema import ActorConfig, AlgorithmConfig, WorkerConfig
from asyncrl.device import torch_dtype
from asyncrl.learner.critic import CriticSettings, TorchCritic, ValueModel, critic_model_path
from asyncrl.learner.objective import lr_factor, make_optimizer
from asyncrl.learner.torch import fsdp

# The critic's part of the learner's DCP directory (beside the policy's "model", "optimizer").
DCP_KEY = "critic"


def build_critic(
    section: WorkerConfig,
    actor_path: str | Path,
    actor: ActorConfig,
    algorithm: AlgorithmConfig,
    device: str,
    total_steps: int,
    rank: int = 0,
    world_size: int = 1,
) -> TorchCritic:
    """The value model (the trunk of the HF model at the critic's path, which defaults to the
    actor's, plus a zero value head) on the learner's device, its optimizer and schedule; with
    `world_size` > 1 sharded over the default process group as the policy is (`fsdp.shard`)."""
    from transformers import AutoModel

    path = critic_model_path(section.model_args.model_name_or_path, actor_path)
    dtype = torch_dtype(section.model_args.dtype or "fp32")
    # AutoModel is the architecture without its LM head (Qwen2ForCausalLM -> Qwen2Model): the
    # checkpoint's trunk weights load, the vocabulary projection is never built.
    master = fsdp.master_dtype(dtype, device, world_size)  # fp32 under mixed precision
    trunk = AutoModel.from_pretrained(path, dtype=master)
    text = trunk.config.get_text_config() if hasattr(trunk.config, "get_text_config") else None
    model = ValueModel(trunk, int((text or trunk.config).hidden_size)).to(device)
    if not section.model_args.disable_gradient_checkpointing:
        # transformers 5 renamed it; the old name (all that 4.x has) warns there
        enable = getattr(trunk, "activation_checkpointing_enable", None)
        (enable or trunk.gradient_checkpointing_enable)()
    if fsdp.sharded(world_size):
        _shard(model, device, dtype)
    targs, optim = section.training_args, actor.optim
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], targs, optim)
    settings = CriticSettings(
        cliprange_value=algorithm.cliprange_value,
        loss_agg_mode=actor.loss_agg_mode,
        ppo_epochs=actor.ppo_epochs,
        # the plan's rule over the critic's own micro-batch and accumulation
        mini_batch_size=step_size(actor, targs, world_size, "critic"),
        micro_batch_size=targs.per_device_train_batch_size,
        infer_batch_size=section.infer_batch_size,
        max_grad_norm=targs.max_grad_norm,
        shuffle=actor.shuffle,
        pack_budget=actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None,
    )
    lr = lr_factor(targs, optim, total_steps)
    return TorchCritic(model, opt, lr, settings, rank=rank, world_size=world_size)


def _shard(model: ValueModel, device: str, dtype: torch.dtype) -> None:
    """FSDP2 per decoder layer and at the root, as the policy. The value head is an FSDP unit
    of its own: it stays fp32 (an FSDP unit's parameters share one dtype, and a bf16 trunk's
    root would not) and computes in fp32 under a mixed precision policy too."""
    fsdp.shard(model.value_head, device, torch.float32)
    fsdp.shard(model, device, dtype)


def dcp_state(critic: TorchCritic, optimizer: bool = True) -> dict[str, Any]:
    """The critic's model (and optimizer) for DCP: each rank its shards, keyed by name."""
    return fsdp.dcp_state({"model": critic.model}, critic.optimizer if optimizer else None)


def load_state(critic: TorchCritic, state: dict[str, Any], sharded_dir: str | None) -> None:
    """Restore `TorchCritic.state_dict` saved by any rank count onto this one: a sharded save
    from the learner's DCP directory (its `DCP_KEY` part), a whole one into this rank's shards
    or as it is; the optimizer only where `state` has one (a checkpoint may leave it out)."""
    modules = {"model": critic.model}
    optimizer = critic.optimizer if "optimizer" in state else None
    sharded = fsdp.sharded(critic.world_size)
    if state.get("model") == "sharded":
        if sharded_dir is None:
            raise ValueError("the critic's state is sharded but no sharded_dir was given")
        import torch.distributed.checkpoint as dcp

        wanted = {DCP_KEY: fsdp.dcp_state(modules, optimizer)}
        # one process reads alone, even where a default process group exists for something else
        dcp.load(wanted, checkpoint_id=str(sharded_dir), no_dist=not sharded)
        fsdp.apply_dcp_state(modules, optimizer, wanted[DCP_KEY])
    elif sharded:  # a one-process learner.pt: whole tensors into this rank's shards
        fsdp.load_full(modules, optimizer, state)
    else:
        critic.load_state_dict(state)
        return
    critic.load_schedule(state)

"""The torch learner's models. The policy: loaded from its HF directory in the master dtype, on
its device, with activation checkpointing as `model_args` says, and wrapped with a LoRA adapter
(peft) when `model_args.lora_rank` > 0. The KL reference (`asyncrl.learner.reference`). Sharding
(FSDP2) comes after, in the learner."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.config.schema import ActorConfig, ModelArgs
from asyncrl.device import torch_dtype
from asyncrl.learner import lora
from asyncrl.learner.reference import ReferenceSpec, frozen
from asyncrl.learner.torch import fsdp, lean_policy


@dataclass(frozen=True)
class Policy:
    model: torch.nn.Module
    """The trained model (a peft model with LoRA)."""
    dtype: torch.dtype
    """`model_args.dtype`: the compute dtype (FSDP2's mixed precision param dtype)."""
    sync_dtype: torch.dtype | None
    """What the engines receive when the masters are kept in another dtype, else None."""
    lora: bool
    """Whether only a LoRA adapter trains."""


def load_policy(
    model_path: str | Path,
    args: ModelArgs,
    device: str,
    world_size: int,
    actor: ActorConfig | None = None,
) -> Policy:
    """The policy per `args` (actor_train's `model_args`): read without transformers' modeling
    code where `lean_policy.why_not` takes it for `actor`'s forwards, else transformers'. The
    caller seeds torch first (a fresh adapter's A is random)."""
    dtype = torch_dtype(args.dtype or "fp32")
    master = fsdp.master_dtype(dtype, device, world_size)  # fp32 under mixed precision
    lean = actor is not None and lean_policy.why_not(args, actor, device, world_size) is None
    model = lean_policy.lean_policy(model_path, master) if lean else None
    if model is None:
        from transformers import AutoModelForCausalLM

        attn = {"attn_implementation": a} if (a := args.attn_implementation) else {}
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=master, **attn)
        model.to(device)
    if args.actor_checkpointing():
        # transformers 5 renamed it; the old name (all that 4.x has) warns there
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    if args.lora_rank > 0:
        if args.actor_checkpointing():
            # Reentrant checkpointing of a frozen base would leave the adapter without
            # gradients: the embeddings' output must require grad (peft's documented fix).
            model.enable_input_require_grads()
        model = lora.wrap(model, args)
    return Policy(model, dtype, dtype if master != dtype else None, args.lora_rank > 0)


def load_reference(spec: ReferenceSpec | None, policy: Policy, device: str) -> torch.nn.Module:
    """The KL reference policy: the configured model (`spec`) in its dtype (null: the actor's),
    else the initial actor: with LoRA the policy with its adapter off (the base never trains),
    otherwise a frozen copy. Frozen, in eval mode."""
    if spec is None and policy.lora:
        return lora.AdapterOff(policy.model)
    if spec is None:
        return frozen(copy.deepcopy(policy.model))
    from transformers import AutoModelForCausalLM

    # Every strategy name (fsdp2_train, hf_infer, megatron_infer) scores the same HF model
    # directory; here it is a transformers model in this process, on the learner's device.
    dtype = torch_dtype(spec.dtype) if spec.dtype else policy.model.dtype
    ref = AutoModelForCausalLM.from_pretrained(spec.path, dtype=dtype)
    return frozen(ref.to(device))

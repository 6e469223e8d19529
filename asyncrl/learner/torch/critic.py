"""Build the torch learner's critic from the `critic:` section (see `asyncrl.learner.critic`)."""

from __future__ import annotations

from pathlib import Path

from asyncrl.config.schema import ActorConfig, AlgorithmConfig, WorkerConfig
from asyncrl.device import torch_dtype
from asyncrl.learner.critic import CriticSettings, TorchCritic, ValueModel, critic_model_path
from asyncrl.learner.objective import lr_factor, make_optimizer


def build_critic(
    section: WorkerConfig,
    actor_path: str | Path,
    actor: ActorConfig,
    algorithm: AlgorithmConfig,
    device: str,
    total_steps: int,
) -> TorchCritic:
    """The value model (the trunk of the HF model at the critic's path, which defaults to the
    actor's, plus a zero value head) on the learner's device, its optimizer and schedule."""
    from transformers import AutoModel

    path = critic_model_path(section.model_args.model_name_or_path, actor_path)
    dtype = torch_dtype(section.model_args.dtype or "fp32")
    # AutoModel is the architecture without its LM head (Qwen2ForCausalLM -> Qwen2Model): the
    # checkpoint's trunk weights load, the vocabulary projection is never built.
    trunk = AutoModel.from_pretrained(path, dtype=dtype)
    text = trunk.config.get_text_config() if hasattr(trunk.config, "get_text_config") else None
    model = ValueModel(trunk, int((text or trunk.config).hidden_size)).to(device)
    if not section.model_args.disable_gradient_checkpointing:
        # transformers 5 renamed it; the old name (all that 4.x has) warns there
        enable = getattr(trunk, "activation_checkpointing_enable", None)
        (enable or trunk.gradient_checkpointing_enable)()
    targs, optim = section.training_args, actor.optim
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], targs, optim)
    settings = CriticSettings(
        cliprange_value=algorithm.cliprange_value,
        loss_agg_mode=actor.loss_agg_mode,
        ppo_epochs=actor.ppo_epochs,
        mini_batch_size=actor.ppo_mini_batch_size,
        micro_batch_size=targs.per_device_train_batch_size,
        infer_batch_size=section.infer_batch_size,
        max_grad_norm=targs.max_grad_norm,
        shuffle=actor.shuffle,
        pack_budget=actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None,
    )
    return TorchCritic(model, opt, lr_factor(targs, optim, total_steps), settings)

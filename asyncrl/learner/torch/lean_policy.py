"""The policy read straight from its checkpoint's files, without transformers' modeling code, for
a learner on one CPU process whose model `asyncrl.llama` reproduces (Qwen2, Llama).

Why: building the policy with `AutoModelForCausalLM` imports transformers' modeling stack
(modeling, masking, loss and integration modules, which pull in torch._dynamo, torch._inductor,
sympy, scipy and FSDP), most of the driver's start-up on the CPU default; the hf engine reads the
same files this way for the same reason (`engine/hf/lean_model.py`). The modules, names and
parameters are those of transformers' `Qwen2ForCausalLM` / `LlamaForCausalLM`, so weight syncs,
checkpoints and the lean training forward (`learner/lean.py`) see the same model; the config is
transformers' own config class (its configuration module only), so what reads or saves it
(dropout rates, the HF export) is unchanged.

Its forward is the padded path's: `input_ids`, an optional padding `attention_mask` and
`position_ids`, `output_hidden_states` (the final normed hidden states, the only ones the learner
reads) and `logits_to_keep`; the logits are transformers' (`tests/test_lean_policy.py` holds
logits, hidden states and gradients to its forward). Packed forwards, LoRA, activation
checkpointing, a chosen attention implementation, torch.compile, several ranks or an accelerator
keep transformers' model (`why_not`), as does a model with dropout (`lean_policy`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrl import llama
from asyncrl.config.schema import ActorConfig, ModelArgs
from asyncrl.engine.hf.lean_model import CausalLM, lean_model

log = logging.getLogger(__name__)


@dataclass
class LeanOutput:
    """What the learner reads of transformers' `CausalLMOutputWithPast`."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None


class LeanCausalLM(CausalLM):
    """`CausalLM`'s parameters with transformers' padded training forward, computed by
    `asyncrl.llama`, and what the learner calls on a transformers model besides."""

    #: transformers' own for these classes: the head repeats the embedding when tied.
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    @property
    def hf_class_name(self) -> str:
        """transformers' class the export names (`fsdp.save_full`): the config's own, which
        `lean_model` checked it builds."""
        return self.config.architectures[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool = False,
        output_hidden_states: bool = False,
        logits_to_keep: int = 0,
        **unsupported: Any,
    ) -> LeanOutput:
        """Causal attention over each row's non-padding keys (`attention_mask`; none: every
        token real); a padding query attends to itself (finite, never read)."""
        if unsupported:
            raise TypeError(f"lean policy forward: unsupported arguments {sorted(unsupported)}")
        ops = llama.Llama(self)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
            position_ids = position_ids.expand(input_ids.shape[0], -1)
        real = attention_mask is None or bool(attention_mask.bool().all())
        allowed = None if real else llama.prefill_mask(attention_mask)
        h, _ = ops.blocks(ops.embed(input_ids), position_ids, allowed)
        h = llama.norm(h, self.model.norm)
        kept = h[:, -logits_to_keep:] if logits_to_keep else h
        logits = llama.linear(self.lm_head, kept)
        return LeanOutput(logits, (h,) if output_hidden_states else None)

    def save_pretrained(self, path: str | Path) -> None:
        """transformers' export: config, generation config and safetensors (a tied head left
        out, as transformers leaves it out)."""
        from asyncrl.learner.torch import fsdp

        fsdp.pretrained_snapshot(self, iter(self.state_dict().items()))(Path(path))


def why_not(args: ModelArgs, actor: ActorConfig, device: str, world_size: int) -> str | None:
    """Why the policy is built with transformers rather than read here (None: it is read)."""
    from asyncrl.learner.logprobs import pack_budget

    reasons = {
        "an accelerator": device != "cpu",
        "several ranks": world_size != 1,
        "LoRA": args.lora_rank > 0,
        "activation checkpointing": args.actor_checkpointing(),
        "a chosen attention implementation": bool(args.attn_implementation),
        "torch.compile": actor.use_torch_compile,
        "packed forwards": pack_budget(actor) is not None,
    }
    return next((why for why, yes in reasons.items() if yes), None)


def lean_policy(path: str | Path, dtype: torch.dtype) -> torch.nn.Module | None:
    """The policy at `path` in `dtype` on the CPU, or None (why is logged) where `lean_model`
    does not build it exactly."""
    from transformers import AutoConfig, GenerationConfig

    from asyncrl.learner.logprobs import has_dropout

    model = lean_model(path, dtype, "cpu", cls=LeanCausalLM)
    if model is None:
        return None
    model.config = AutoConfig.from_pretrained(path)  # transformers' config: read, saved as is
    model.config.dtype = dtype
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: transformers' model has a default one
        model.generation_config = GenerationConfig.from_model_config(model.config)
    # with transformers' config now; dropout: transformers applies attention dropout inline
    # in training, this forward does not
    why = llama.unsupported(model) or ("dropout" if has_dropout(model) else None)
    if why is not None:
        log.info("learner: transformers loads the model (%s)", why)
        return None
    log.info("learner: the policy is read without transformers' modeling code")
    return model

"""The KL reference policy (ROLL's `reference` worker), as the learner backends read it.

`actor.use_kl_loss` adds `kl_loss_coef · KL(π || π_ref)` to the policy loss, and
`algorithm.use_kl_in_reward` subtracts `beta · kl(π_old, π_ref)` from every token's reward
(fsdp2_train). π_ref is

- with `reference: null`, a frozen copy of the initial actor (the learner's own weights when it
  is built, before any update);
- with a `reference:` section, the model at `reference.model_args.model_name_or_path` (empty:
  the actor's own model directory) in `reference.model_args.dtype` (null: the actor's dtype),
  loaded inside the learner's process on the learner's devices, frozen, in eval mode; its
  logprobs are computed `reference.infer_batch_size` rows at a time, of `logits / temperature`
  like every other logprob pass.

The reference scores the actor's token ids, so it must share the actor's tokenizer: the two
models' vocabulary sizes (embedding rows) must be equal, checked before any weight loads.
Nothing here imports torch: the Megatron learner reads the same rules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.config.schema import WorkerConfig

if TYPE_CHECKING:  # torch only for the annotation: validation imports this module
    import torch


class ReferenceConfigError(ValueError):
    """A `reference:` section the learner cannot honour; one line naming the key."""


@dataclass(frozen=True)
class ReferenceSpec:
    """What the learner loads as the reference policy (from a `reference:` section)."""

    path: Path
    """HF model directory of the reference (the actor's own when the section names none)."""
    dtype: str | None
    """fp32 | bf16 | fp16; None: the actor's dtype."""
    infer_batch_size: int
    """Rows per reference logprob forward pass."""
    strategy_name: str
    """fsdp2_train | hf_infer | megatron_infer, as configured."""


def reference_spec(
    reference: WorkerConfig | None,
    actor_path: str | Path,
    train: WorkerConfig,
    uses_reference: bool,
) -> ReferenceSpec | None:
    """The reference to load for `actor_train` (`train`, model at `actor_path`), or None for
    the frozen initial actor; `uses_reference`: use_kl_loss or use_kl_in_reward is on.
    Refuses a section nothing would read or that the learner cannot
    place, and a model whose vocabulary differs from the actor's."""
    if reference is None:
        return None
    if not uses_reference:
        raise ReferenceConfigError(
            "reference: set, but actor.use_kl_loss is false and so is "
            "algorithm.use_kl_in_reward (only they read the reference policy)"
        )
    mapping, train_mapping = list(reference.device_mapping), list(train.device_mapping)
    if mapping and mapping != train_mapping:
        raise ReferenceConfigError(
            f"reference.device_mapping {mapping} differs from actor_train.device_mapping "
            f"{train_mapping}: the reference runs inside the learner, on actor_train's devices"
        )
    path = Path(reference.model_args.model_name_or_path or actor_path)
    check_same_vocab(Path(actor_path), path)
    return ReferenceSpec(
        path=path,
        dtype=reference.model_args.dtype,
        infer_batch_size=reference.infer_batch_size,
        strategy_name=reference.strategy_args.strategy_name,
    )


def vocab_size(model_dir: Path, role: str, error: type[ValueError] = ReferenceConfigError) -> int:
    """Embedding rows of the HF model at `model_dir` (its text config's `vocab_size`); `error`:
    the config error the caller's role raises."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise error(
            f"{role}.model_args.model_name_or_path {model_dir} is not a Hugging Face model "
            "directory (no config.json)"
        )
    config = json.loads(config_file.read_text())
    # Multimodal configs nest the language model's sizes under text_config.
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    if not isinstance(size, int) or size <= 0:
        raise error(f"{config_file} has no positive vocab_size")
    return size


def check_same_vocab(actor_path: Path, reference_path: Path) -> None:
    """Refuse, in one line naming both models, a reference whose vocabulary size differs."""
    actor, ref = vocab_size(actor_path, "actor_train"), vocab_size(reference_path, "reference")
    if actor != ref:
        raise ReferenceConfigError(
            f"reference.model_args.model_name_or_path {reference_path} has vocab_size {ref} but "
            f"the actor ({actor_path}) has {actor}: the reference must share the actor's "
            "tokenizer and vocabulary"
        )


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in eval mode with every parameter frozen (the KL reference never trains)."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model

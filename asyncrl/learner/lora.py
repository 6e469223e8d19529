"""LoRA for the torch learner, through peft: wrap, the adapter-off reference, sync and export.

The policy is `PeftModel(base)`: only the adapter (`lora_A`, `lora_B` of every targeted linear
layer) trains; the base keeps `model_args.dtype` and never changes, so the KL reference with
`reference: null` is the same model with the adapter disabled (no second copy of the base).

Two ways out of the learner, both under the base model's Hugging Face names:
- `adapter_tensors`: per targeted layer `M`, `M.lora_A.weight` [r, in] and `M.lora_B.weight`
  [out, r] with the LoRA scaling already folded into B, so an engine needs no adapter config to
  serve W = W0 + B·A (`asyncrl.engine.hf.weights` keeps W0 pristine and recomputes it per sync);
- `merged_tensors`: the full state dict with every targeted weight merged (W0 + ΔW by peft's
  own `get_delta_weight`), for engines that take full weights only (SGLang in `merge` mode) and
  for the HF export.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from asyncrl.config.schema import ModelArgs
from asyncrl.learner.dtensor import local_value  # a DTensor's full value: a collective
from asyncrl.weights.buckets import LORA_A, LORA_B

ADAPTER = "default"  # peft's adapter name: the policy has exactly one


class LoraSetupError(ValueError):
    """The model cannot take the configured adapter; one line naming the key."""


def wrap(model: torch.nn.Module, args: ModelArgs) -> Any:
    """`model` as a peft LoRA model (fresh adapter: B = 0, so the policy starts as the base).
    Only plain linear layers may be targeted: the adapter sync folds B·A into `weight`."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    config = LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.target_modules,
        exclude_modules=list(args.lora_target_exclude) or None,
        use_rslora=args.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as e:  # peft's "Target modules ... not found in the base model"
        first = str(e).splitlines()[0]
        raise LoraSetupError(f"actor_train.model_args.target_modules: {first}") from None
    tied = tied_copies(model)  # an adapter on a tied head would move the embedding with it
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and f"{hf_name(name)}.weight" in tied:
            raise LoraSetupError(
                f"actor_train.model_args.target_modules: {hf_name(name)} is tied to the "
                "input embedding (tie_word_embeddings); an adapter cannot change it alone"
            )
        if isinstance(module, LoraLayer) and not isinstance(module, LoraLinear):
            raise LoraSetupError(
                f"actor_train.model_args.target_modules: {hf_name(name)} is a "
                f"{type(module.get_base_layer()).__name__}, not a linear layer"
            )
        if isinstance(module, LoraLinear) and module.fan_in_fan_out:
            raise LoraSetupError(f"{hf_name(name)}: Conv1D (fan_in_fan_out) layers unsupported")
    return peft_model


def hf_name(peft_name: str) -> str:
    """A module or parameter name of the peft model under the base model's HF name."""
    return peft_name.removeprefix("base_model.model.").replace(".base_layer", "")


def lora_layers(peft_model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """(HF module name, peft LoRA layer) for every adapted layer, in module order."""
    from peft.tuners.lora import LoraLayer

    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield hf_name(name), module


def _factors(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, scaling·B) of one adapted layer, whole (gathered from the shards when sharded)."""
    a = local_value(layer.lora_A[ADAPTER].weight.detach())
    b = local_value(layer.lora_B[ADAPTER].weight.detach())
    return a, b * layer.scaling[ADAPTER]


@torch.no_grad()
def adapter_tensors(peft_model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter as synced: per layer A and scaling·B (see the module docstring). Sharded,
    every rank must iterate it to the end (one all-gather per factor)."""
    for name, layer in lora_layers(peft_model):
        a, b = _factors(layer)
        yield f"{name}.{LORA_A}", a
        yield f"{name}.{LORA_B}", b


@torch.no_grad()
def merged_tensors(
    peft_model: Any, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The full model under HF names, each adapted weight merged: W0 + scaling·B·A, computed in
    fp32 and stored in the base's dtype, or `dtype` (peft's `get_delta_weight` for a plain
    linear layer, the only kind `wrap` admits), less the tied copies (`tied_copies`). Sharded,
    every rank must iterate it to the end."""
    layers = dict(lora_layers(peft_model))
    base = peft_model.get_base_model()
    skip = tied_copies(base)
    for name, tensor in base.state_dict().items():
        if ".lora_" in name or hf_name(name) in skip:
            continue
        name = hf_name(name)
        tensor = local_value(tensor.detach())
        module, _, leaf = name.rpartition(".")
        layer = layers.get(module)
        if layer is not None and leaf == "weight":
            a, b = _factors(layer)
            tensor = (tensor.float() + b.float() @ a.float()).to(tensor.dtype)
        yield name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def tied_copies(model: torch.nn.Module) -> set[str]:
    """The HF names that only repeat another parameter: HF's `_tied_weights_keys` (e.g.
    `lm_head.weight`) when the config ties the embeddings. Neither synced nor exported: SGLang
    serves the embedding as the head and skips the copy (with a warning), the hf engine's head
    is the embedding's parameter, and `save_pretrained` leaves it out too. The same on every
    rank (a config), so sharded ranks skip the same all-gathers."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if not getattr(text or config, "tie_word_embeddings", False):
        return set()
    return set(getattr(model, "_tied_weights_keys", None) or ())


class AdapterOff(torch.nn.Module):
    """The KL reference of a LoRA policy: the policy's forward with its adapter disabled.
    Holds no weights of its own (the peft model is kept out of the module tree), so nothing is
    copied and its `state_dict` is empty."""

    def __init__(self, peft_model: Any) -> None:
        super().__init__()
        self._policy = [peft_model]  # a list: not registered as a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        policy = self._policy[0]
        with policy.disable_adapter():
            return policy(*args, **kwargs)


def adapter_state(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter's trainable tensors (peft's own keys), as a checkpoint stores them."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}


def load_adapter_state(peft_model: Any, state: dict[str, torch.Tensor]) -> None:
    """Load `adapter_state`'s output; every adapter tensor must be present."""
    from peft import set_peft_model_state_dict

    missing = set(adapter_state(peft_model)) - set(state)
    if missing:
        raise LoraSetupError(
            f"checkpoint adapter lacks {len(missing)} tensor(s), first {sorted(missing)[0]!r} "
            "(saved with another lora_rank or target_modules?)"
        )
    set_peft_model_state_dict(peft_model, state)


def check_kind(state: dict[str, Any], lora_rank: int) -> None:
    """A learner checkpoint of the other kind (with or without an adapter) is refused in one
    line."""
    if bool(state.get("lora", False)) != (lora_rank > 0):
        raise LoraSetupError(
            f"checkpoint {'has' if state.get('lora') else 'has no'} LoRA adapter but "
            f"actor_train.model_args.lora_rank is {lora_rank}"
        )


def load_model_state(model: Any, state: dict[str, Any], lora_rank: int) -> None:
    """Load a learner checkpoint's `model` entry: the adapter with LoRA, else the full model."""
    check_kind(state, lora_rank)
    if lora_rank > 0:
        load_adapter_state(model, state["model"])
    else:
        model.load_state_dict(state["model"])


def under_model_names(peft_model: Any, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`adapter_state`'s tensors (peft's keys, no adapter name) under the model's own parameter
    names, as a sharded load takes them; every adapter tensor must be present."""
    names = {k.replace(f".{ADAPTER}.", "."): k for k in peft_model.state_dict() if ".lora_" in k}
    missing = sorted(set(names) - set(state))
    if missing:
        raise LoraSetupError(
            f"checkpoint adapter lacks {len(missing)} tensor(s), first {missing[0]!r} "
            "(saved with another lora_rank or target_modules?)"
        )
    return {names[k]: v for k, v in state.items() if k in names}


def whole_adapter(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter's parameters under the model's own names, whole and on the CPU (sharded:
    gathered, every rank must call it): what `PeftModel.save_pretrained(state_dict=…)` reads."""
    return {k: local_value(v.detach()).to("cpu", copy=True)
            for k, v in peft_model.state_dict().items() if ".lora_" in k}  # fmt: skip

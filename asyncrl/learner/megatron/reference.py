"""The KL reference policy of the Megatron learner (`reference:` with `megatron_train`).

The reference is a second Megatron model built with the actor's plan: the same parallel layout
(TP/PP/EP shards on the same ranks), the same dtype and so the same architecture, loaded
frozen from its own HF directory (`reference.model_args.model_name_or_path`; empty: the actor's
own weights, the initial actor). A reference that would need another plan (another
architecture, another dtype) is refused in one line, before any process group starts; the
general rules (vocabulary, devices, `use_kl_loss`) are `asyncrl.learner.reference`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.learner.megatron.args import plan
from asyncrl.learner.megatron.name_mapping import ModelShape
from asyncrl.learner.reference import ReferenceConfigError, ReferenceSpec, reference_spec

# TransformerConfig fields that only initialise weights: a reference may differ in them.
INIT_ONLY = frozenset({"init_method_std"})


def megatron_reference(
    reference: Any, model_path: str | Path, train: Any, actor: Any, builtin: bool
) -> ReferenceSpec | None:
    """The reference to build next to the actor, or None for the frozen initial actor.
    `builtin`: asyncrl's own GPTModel path (False: Megatron-Bridge builds the models)."""
    spec = reference_spec(reference, model_path, train, actor.use_kl_loss)
    if spec is None:
        return None
    dtype = train.model_args.dtype or "bf16"  # the Megatron learner's default (args.plan)
    if spec.dtype is not None and spec.dtype != dtype:
        raise ReferenceConfigError(
            f"reference.model_args.dtype {spec.dtype} with megatron_train: the reference is built "
            f"in actor_train's dtype ({dtype}); leave it null or set {dtype}"
        )
    actor_hf = _hf_config(Path(model_path))
    ref_hf = _hf_config(spec.path)
    if _layout(train, actor, actor_hf, builtin) != _layout(train, actor, ref_hf, builtin):
        raise ReferenceConfigError(
            f"reference.model_args.model_name_or_path {spec.path} is not the architecture of the "
            f"actor ({model_path}): with megatron_train the reference is built with the actor's "
            "Megatron layout"
        )
    return spec


def _hf_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def _layout(train: Any, actor: Any, hf: dict[str, Any], builtin: bool) -> tuple:
    """What the model built from `hf` under the actor's settings looks like: its forward
    (TransformerConfig and GPTModel arguments) and, on the built-in path, its HF weight shapes."""
    tp = int(train.strategy_args.strategy_config.get("tensor_model_parallel_size") or 1)
    shape = ModelShape.from_hf_config(hf).padded_to(tp) if builtin else None
    rows = shape.vocab_rows if shape is not None else 0
    built = plan(train, actor.optim, hf, rows, builtin=builtin)
    forward = {k: v for k, v in built.transformer.items() if k not in INIT_ONLY}
    return forward, built.model, shape

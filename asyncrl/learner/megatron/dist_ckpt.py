"""The Megatron learner's sharded checkpoint: megatron-core's distributed checkpointing.

Every rank writes its own shards of the model and optimizer into one directory (the
checkpoint's `learner/`, which every rank's node must reach), in Megatron's `torch_dist`
format: each tensor is saved under its global key and its place in the global tensor
(`sharded_state_dict()`: the tensor-parallel split, the pipeline stage's layer offsets, the
data-parallel replica that writes it), so a later run of another TP/PP/DP/VPP layout, or of
another rank count, reads back the pieces of the global tensors its own shards cover.

The optimizer state is kept per model parameter, in the model's own global tensors: Adam's
moments (and the fp32 main parameters of a half-precision model) of every parameter. Without
the distributed optimizer that is Megatron's regular form; with it, its `fully_reshardable`
form (at a save each data-parallel group gathers its flat buffers back into per-parameter
tensors, for a moment the optimizer state of the rank's model shard on each rank; a load reads
them and keeps its own slice). Both forms share their keys, so a state loads onto any layout,
with or without the distributed optimizer. (Megatron's default, `fully_sharded_model_space`,
no longer saves in 0.16+; `dp_reshardable` resumes onto another DP size only.) The step count
travels in the parameter groups. megatron-core 0.15-0.19 share these calls (`save`, `load`,
`sharded_state_dict(model_sd, is_loading, metadata=...)`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# the distributed optimizer's form reshardable over TP, PP and DP (0.15-0.19)
OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def _chunk_states(chunks: list[Any]) -> dict[str, Any]:
    """Each model chunk's sharded state dict (keys global: the nesting does not matter to a
    load, so a VPP save loads without VPP and back)."""
    from asyncrl.learner.megatron.weights import unwrap

    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)}


def sharded_state(chunks: list[Any], optimizer: Any, with_optimizer: bool,
                  loading: bool) -> dict[str, Any]:  # fmt: skip
    """What a save writes / a load fills in: the model chunks and (`with_optimizer`) the
    optimizer state mapped onto them."""
    state = _chunk_states(chunks)
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=loading, metadata=dict(OPTIMIZER_FORMAT)
        )
    return state


def save(chunks: list[Any], optimizer: Any, path: str | Path, with_optimizer: bool) -> None:
    """This rank's shards into `path` (existing, empty; every rank calls it: collective)."""
    from megatron.core import dist_checkpointing

    with torch.no_grad():
        dist_checkpointing.save(sharded_state(chunks, optimizer, with_optimizer, False), str(path))


def load(chunks: list[Any], optimizer: Any, path: str | Path, with_optimizer: bool) -> None:
    """This rank's pieces of what `save` wrote, from any layout (every rank calls it). Without
    the optimizer state the fp32 main parameters are refreshed from the loaded weights."""
    from megatron.core import dist_checkpointing

    from asyncrl.learner.megatron.weights import unwrap

    state = sharded_state(chunks, optimizer, with_optimizer, True)
    loaded = dist_checkpointing.load(state, str(path))
    with torch.no_grad():
        for i, chunk in enumerate(chunks):
            unwrap(chunk).load_state_dict(loaded[f"model{i}"])
        if not with_optimizer:
            optimizer.reload_model_params()
            return
        parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        # a ChainedOptimizer of one part saves that part's state, of several one per index
        states = [loaded["optimizer"]] if len(parts) == 1 else [
            v for _, v in sorted(loaded["optimizer"].items())]  # fmt: skip
        for part, part_state in zip(parts, states, strict=True):
            _load_part(part, part_state)
    if len(parts) > 1 and hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()  # what ChainedOptimizer.load_state_dict does after


def _load_part(part: Any, state: dict[str, Any]) -> None:
    """One optimizer's state. The distributed optimizer's per-parameter state is loaded after
    its parameter groups with the `step` entries held aside: with torch's Adam (no Apex or
    Transformer Engine) each parameter's state holds a `step` tensor, which Megatron's
    `fully_reshardable` load (0.15-0.19) copies from the checkpoint's per-parameter tensors,
    where it never is (the step travels in the parameter groups)."""
    from asyncrl.learner.megatron.optim_state import unshare_steps

    reshardable = state.get("param_state_sharding_type") == OPTIMIZER_FORMAT[
        "distrib_optim_sharding_type"]  # fmt: skip
    param_state = state.pop("param_state", None) if reshardable else None
    if reshardable:
        state.pop("param_state_sharding_type")
    part.load_state_dict(state)  # parameter groups and step (Megatron's per-parameter state)
    unshare_steps(part)
    if param_state is None:
        return
    inner = part.optimizer.state
    steps = {p: s.pop("step") for p, s in inner.items() if "step" in s}
    try:
        part.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for p, step in steps.items():
            inner[p]["step"] = step

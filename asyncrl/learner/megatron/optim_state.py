"""A Megatron rank's optimizer state in older checkpoints' learner.pt, and what a sharded one
(`dist_ckpt`, the checkpoints written now) cannot reshard (`check_reshardable`).

In such a learner.pt each rank's optimizer holds the state of its own shard: its TP/PP/CP
slice of the model and, with the distributed optimizer, its DP slice of every bucket. It keeps
one state per rank, with the parallel layout that produced it, and resumes only onto the same
layout (another one is refused in one line; `actor.checkpoint.load_contents` without
`optimizer` resumes the weights alone).

The distributed optimizer's `state_dict()` leaves the parameter state out (Megatron saves it
separately, `save_parameter_state`/`sharded_state_dict`); here it is taken with
`get_parameter_state_dp_reshardable()` (the rank's own buckets, no communication) and given
back through `load_state_dict`'s `param_state` (sharding type `dp_reshardable`), so a
distributed-optimizer rank resumes its Adam moments and fp32 main parameters too.
"""

from __future__ import annotations

from typing import Any

import torch

RESHARDABLE = "dp_reshardable"


class OptimizerLayoutError(ValueError):
    """A checkpoint's optimizer state belongs to another parallel layout."""


def parallel_layout(plan_parallel: dict[str, Any], world: int, distributed: bool) -> dict:
    """What a rank-local optimizer state depends on: the rank count and every parallel size."""
    sizes = {k: int(v or 1) for k, v in sorted(plan_parallel.items())}  # None: Megatron's 1
    return {"world": int(world), **sizes, "distributed_optimizer": bool(distributed)}


def _parts(optimizer: Any) -> list[Any]:
    # get_megatron_optimizer returns a ChainedOptimizer when it builds more than one (e.g.
    # separate groups); each part is saved and loaded on its own.
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def rank_state(optimizer: Any) -> list[dict[str, Any]]:
    """This rank's optimizer state on the CPU (a copy later steps cannot change)."""
    from asyncrl.learner.torch.fsdp import stage_to_cpu

    out = []
    for part in _parts(optimizer):
        entry: dict[str, Any] = {"common": part.state_dict()}
        if hasattr(part, "get_parameter_state_dp_reshardable"):  # DistributedOptimizer
            state = part.get_parameter_state_dp_reshardable()
            for key, dtypes in state.items():
                if isinstance(key, int):  # buffer index -> dtype -> bucket -> params
                    for buckets in dtypes.values():
                        for bucket in buckets:
                            for tensors in bucket:  # the loader skips padding entries; the
                                tensors["padding"] = False  # rank's own state has none
            entry["param_state"] = state
        out.append(entry)
    return stage_to_cpu(out)


def load_rank_state(optimizer: Any, state: list[dict[str, Any]]) -> None:
    """Give `rank_state`'s result back to the same rank of the same layout."""
    parts = _parts(optimizer)
    if len(parts) != len(state):
        raise OptimizerLayoutError(
            f"the checkpoint has {len(state)} optimizer part(s), this rank {len(parts)}"
        )
    for part, entry in zip(parts, state, strict=True):
        common = dict(entry["common"])
        if "param_state" in entry:
            common["param_state"] = entry["param_state"]
            common["param_state_sharding_type"] = RESHARDABLE
        with torch.no_grad():  # copies into the (leaf, grad-requiring) main parameters
            part.load_state_dict(common)
        unshare_steps(part)
    if len(parts) > 1 and hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()  # what ChainedOptimizer.load_state_dict does after


def unshare_steps(part: Any) -> None:
    """The distributed optimizer's load gives every parameter the same `step` tensor when the
    inner optimizer is torch's Adam (no Apex/TE); Adam increments each parameter's step in
    place, so a shared one would advance once per parameter per step (wrong bias correction).
    Each parameter gets its own copy."""
    inner = getattr(part, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


def check_layout(saved: dict[str, Any] | None, current: dict[str, Any]) -> None:
    """Refuse a rank-local optimizer state saved under another layout, in one line."""
    if saved is not None and saved != current:
        diff = ", ".join(
            f"{k} {saved.get(k)} -> {current.get(k)}"
            for k in sorted(set(saved) | set(current))
            if saved.get(k) != current.get(k)
        )
        raise OptimizerLayoutError(
            f"the checkpoint's Megatron optimizer state is per rank and its layout differs "
            f"({diff}); resume the weights alone with actor.checkpoint.load_contents "
            f"without 'optimizer', or keep the layout"
        )


def check_reshardable(saved: dict[str, Any] | None, current: dict[str, Any]) -> None:
    """Refuse, in one line, a sharded optimizer state (`dist_ckpt`) that Megatron cannot load
    here. Any TP/PP/DP/CP/VPP split and rank count loads; the distributed and the regular
    optimizer keep their parameter groups in different forms, so neither loads the other's."""
    key = "distributed_optimizer"
    if saved is None or bool(saved.get(key)) == bool(current.get(key)):
        return
    raise OptimizerLayoutError(
        f"the checkpoint's Megatron optimizer state was saved with use_distributed_optimizer "
        f"{bool(saved.get(key))} and this run has {bool(current.get(key))}; Megatron does not "
        f"convert one optimizer's state into the other's: keep use_distributed_optimizer, or "
        f"resume the weights alone with actor.checkpoint.load_contents without 'optimizer'"
    )

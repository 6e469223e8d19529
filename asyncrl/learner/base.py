"""The learner interface and its factory (keyed on `actor_train.strategy_args.strategy_name`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from asyncrl.types import TrajectoryGroup


class Checkpointable(Protocol):
    """What a checkpoint saves and restores of a learner."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the learner (model, optimizer, scheduler, version)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def save_pretrained(self, path: str | Path) -> None:
        """The policy as a Hugging Face model directory (config.json + safetensors)."""


class Learner(Checkpointable, Protocol):
    """What the loop needs from a training backend; `version` counts optimizer updates."""

    @property
    def version(self) -> int: ...

    def step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """One policy update from a rollout batch; returns metrics; version += 1."""

    def weights_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under Hugging Face names, in a stable order (one at a time)."""

    @property
    def sync_device(self) -> torch.device:
        """The device `weights_for_sync` yields on (rank 0's): the weight sync stages its
        buckets there, joins the update group from there, and makes it current on the threads
        that drive the export (`asyncrl.weights.sync.WeightSource`)."""

    def close(self) -> None:
        """Release what the learner started (rank processes, process groups)."""


def make_learner(name: str, world_size: int = 1, **kwargs: Any) -> Learner:
    """Build the learner for a strategy name; heavy backends are imported only when chosen.
    `world_size` > 1 runs the torch learner as that many data-parallel processes; `placement`
    (a `learner.placement.RankPlacement`) says where ranks 1.. run (default: this node)."""
    placement = kwargs.pop("placement", None)
    if name == "fsdp2_train" and world_size > 1:
        from asyncrl.learner.torch.distributed import DistributedTorchLearner

        return DistributedTorchLearner(world_size, placement, **kwargs)
    if name == "fsdp2_train":
        from asyncrl.device import detect_device, worker_device
        from asyncrl.learner.torch.learner import TorchLearner

        # On a GPU/NPU machine the learner trains on its device_mapping's first device; in a
        # multi-node run on the one Ray holds for it (until the run ends: `reserve`).
        kind = detect_device().kind
        placed = placement.reserve(kind, 1, 1) if placement is not None else None
        if placed is not None and kind != "cpu":
            from asyncrl.learner.placed_ranks import torch_index

            kwargs.setdefault(
                "device", f"{kind}:{torch_index(placed.rank0_device, placed.resource)}"
            )
        kwargs.setdefault("device", worker_device(list(kwargs["train"].device_mapping), kind))
        return TorchLearner(**kwargs)
    if name == "megatron_train":
        from asyncrl.learner.megatron.learner import MegatronLearner  # type: ignore[import-not-found]

        if kwargs.pop("critic", None) is not None:  # the config rules refuse it first
            raise ValueError("a critic with megatron_train is not available (use fsdp2_train)")
        return MegatronLearner(**kwargs, placement=placement)
    raise ValueError(f"unknown learner strategy {name!r}; valid: fsdp2_train, megatron_train")

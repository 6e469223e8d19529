"""Multi-process data-parallel training for the torch learner (DDP over gloo/nccl).

Rank 0 is a `TorchLearner` in the driver process (so weight sync and checkpoints stay where they
are); ranks 1..W-1 are Ray actors holding replicas. Every `step` hands the whole batch to every
rank; each trains on its shard (row r on rank r % W) and DDP averages the gradients, so all
replicas stay identical. The training group is the default process group of each process; the
weight-update group to the engines is a separate standalone group and never mixes with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from asyncrl.learner.objective import check_learner_side
from asyncrl.learner.reference import reference_spec
from asyncrl.learner.torch.learner import TorchLearner
from asyncrl.net import free_port


class _RemoteRank:
    """Ray actor body: join the training group, then mirror rank 0's calls on a replica."""

    def __init__(self, kwargs: dict[str, Any], rank: int, world: int, init_method: str) -> None:
        torch.distributed.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world
        )
        self.learner = TorchLearner(**kwargs, rank=rank, world_size=world)

    def step(self, groups: list[Any]) -> None:
        self.learner.step(groups)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.learner.load_state_dict(state)


class DistributedTorchLearner:
    """`Learner` over W data-parallel processes; behaves like one TorchLearner to the loop.
    `kwargs` are TorchLearner's (`reference` included: every rank loads its own frozen copy)."""

    def __init__(self, world_size: int, **kwargs: Any) -> None:
        import ray

        from asyncrl.net import init_ray

        if world_size < 2:
            raise ValueError("DistributedTorchLearner needs world_size >= 2")
        alg = kwargs["algorithm"]  # before any rank process starts:
        check_learner_side(alg, kwargs.get("critic") is not None, world_size)
        reference_spec(  # likewise: a reference of another vocabulary fails here, once
            kwargs.get("reference"), kwargs["model_path"], kwargs["train"],
            kwargs["actor"].use_kl_loss or alg.use_kl_in_reward,
        )  # fmt: skip
        init_ray()
        self._ray = ray
        host = "127.0.0.1"
        init_method = f"tcp://{host}:{free_port(host)}"
        remote_cls = ray.remote(num_cpus=0)(_RemoteRank)
        self.remotes = [
            remote_cls.remote(kwargs, rank, world_size, init_method)
            for rank in range(1, world_size)
        ]
        # Rank 0 joins last: init_process_group returns once every rank has arrived.
        torch.distributed.init_process_group(
            "gloo", init_method=init_method, rank=0, world_size=world_size
        )
        self.local = TorchLearner(**kwargs, rank=0, world_size=world_size)

    @property
    def version(self) -> int:
        return self.local.version

    def step(self, groups: list[Any]) -> dict[str, float]:
        ref = self._ray.put(groups)
        pending = [r.step.remote(ref) for r in self.remotes]
        metrics = self.local.step(groups)
        self._ray.get(pending)  # surfaces a failed rank as an error here
        metrics["learner/world_size"] = float(len(self.remotes) + 1)
        return metrics

    def weights_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.local.weights_for_sync()

    def adapter_for_sync(self) -> Iterator[tuple[str, torch.Tensor]] | None:
        return self.local.adapter_for_sync()  # every rank holds the same adapter

    def save_pretrained(self, path: Any) -> None:
        self.local.save_pretrained(path)

    def state_dict(self) -> dict[str, Any]:
        return self.local.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ref = self._ray.put(state)
        pending = [r.load_state_dict.remote(ref) for r in self.remotes]
        self.local.load_state_dict(state)
        self._ray.get(pending)

    def close(self) -> None:
        for remote in self.remotes:
            self._ray.kill(remote, no_restart=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

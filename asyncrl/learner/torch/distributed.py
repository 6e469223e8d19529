"""The torch learner over W processes, sharded with FSDP2 (`asyncrl.learner.torch.fsdp`).

Rank 0 is a `TorchLearner` in the driver process (so weight sync and checkpoints stay where they
are); ranks 1..W-1 are Ray actors (`asyncrl/learner/placement.py`). On the CPU the ranks meet
over gloo; on a node's GPUs/NPUs each rank computes on its `actor_train.device_mapping` entry
(`rank_devices`), across nodes on the device Ray gave it (`placed_ranks.py`), and the group
runs NCCL/HCCL for device tensors, gloo for CPU ones. Every `step` hands the whole batch to
every rank; each trains on its rows (row r on rank r % W) while FSDP2 all-gathers the
parameters of each layer for its forward/backward and reduce-scatters the gradients, so each
rank holds 1/W of the parameters, gradients and optimizer state. Since every forward,
backward and full-tensor gather is a collective, whatever rank 0 does with the model the
remote ranks do concurrently, in the same order: `weights_for_sync` (and the HF export) make
them run the same gathers and discard them.

Two groups per process: the training group (the default process group: forwards, backwards,
metrics) and a checkpoint group (gloo) that DCP uses, so a checkpoint written in the background
(`actor.checkpoint.async_save`) never interleaves its collectives with a training step's. The
weight-update group to the engines is a separate standalone group and never mixes with either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from asyncrl.device import DeviceSpec, detect_device, device_spec, select_device
from asyncrl.learner.objective import check_learner_side
from asyncrl.learner.placed_ranks import PlacedRanks, torch_index
from asyncrl.learner.placement import RankActor, RankPlacement, RankWatch, Rendezvous
from asyncrl.learner.reference import reference_spec
from asyncrl.learner.torch import fsdp
from asyncrl.learner.torch.learner import TorchLearner
from asyncrl.threads import ThreadShare, apply_thread_share


def rank_devices(
    mapping: Sequence[int], spec: DeviceSpec, world: int
) -> list[tuple[str, dict[str, str]]]:
    """(torch device, environment variables) of each rank, rank 0 first. On the CPU every rank
    computes on "cpu". On an accelerator (one node) rank 0 is the driver process, which sees
    every device, and takes `<kind>:<mapping[0]>`; rank r >= 1 is a process that sees only
    device mapping[r] (Ray told not to override the visibility), its `<kind>:0`."""
    if spec.kind == "cpu":
        return [("cpu", {})] * world
    if len(mapping) < world:
        raise ValueError(f"{world} {spec.kind} ranks need {world} device ids, got {list(mapping)}")
    first = [(f"{spec.kind}:{mapping[0]}", {})]
    return first + [(f"{spec.kind}:0", spec.pinned_env(mapping[r])) for r in range(1, world)]


def placed_devices(placed: PlacedRanks, spec: DeviceSpec) -> list[str | None]:
    """Rank 0's torch device (Ray's device id in this process), then None per remote rank:
    each takes the device Ray gave it (`ray_device`). On the CPU (an emulated placement)
    every rank computes on "cpu"."""
    if spec.kind == "cpu":
        return ["cpu"] * len(placed.slots)
    first = f"{spec.kind}:{torch_index(placed.rank0_device, placed.resource)}"
    return [first] + [None] * (len(placed.slots) - 1)


def ray_device(kind: str) -> str:
    """The torch device of the accelerator Ray gave this actor ("cpu" on the CPU)."""
    from asyncrl.learner.placed_ranks import accelerator_ids

    resource = device_spec(kind).ray_resource
    if resource is None:
        return "cpu"
    return f"{kind}:{torch_index(accelerator_ids(resource)[0], resource)}"


def _join(rank: int, world: int, rendezvous: Rendezvous, spec: DeviceSpec, device: str) -> Any:
    """Join the training group (default) and create the checkpoint group; returns the latter.
    Every rank calls this in the same order (new_group is a collective). The rank's device is
    made current first: NCCL/HCCL and FSDP2's DeviceMesh start on the current device."""
    select_device(device)
    rendezvous.join(rank, world, spec.group_backend())
    return torch.distributed.new_group(backend="gloo", timeout=rendezvous.timeout)


class _RemoteRank(RankActor):
    """Ray actor body: once `start`ed, join the groups, then mirror rank 0's calls on this
    rank's shards. It runs two calls at once (max_concurrency=2) only so `wait_save` can wait
    on a background write while the next `step` trains; the driver never overlaps any other
    two calls (nor any with `start`, which it waits for)."""

    def __init__(
        self,
        kwargs: dict[str, Any],
        rank: int,
        world: int,
        meet: Rendezvous,
        kind: str,
        device: str | None,
    ) -> None:
        self.args = (kwargs, rank, world, meet, kind, device)
        self.pending: Future | None = None

    def start(self) -> None:
        """Join the groups and build this rank's learner (`device` None: Ray's)."""
        kwargs, rank, world, meet, kind, device = self.args
        device = device or ray_device(kind)
        self.ckpt_group = _join(rank, world, meet, device_spec(kind), device)
        self.learner = TorchLearner(**kwargs, device=device, rank=rank, world_size=world)

    def step(self, groups: list[Any]) -> None:
        self.learner.step(groups)

    def set_threads(self, share: ThreadShare) -> None:
        """This rank's share of the run's thread budget (a process of its own: for good)."""
        apply_thread_share(share, whole_process=True)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.learner.load_state_dict(state)

    def drain(self, what: str) -> None:
        """Run the gathers rank 0 runs for `what` ("weights": `weights_for_sync`, "adapter":
        `adapter_for_sync`, "export": the HF export), discarding what they gather."""
        if what == "export":
            self.learner.save_pretrained(None)  # not rank 0: gathers, writes nothing
            return
        learner = self.learner
        fsdp.drain(learner.adapter_for_sync() if what == "adapter" else learner.weights_for_sync())

    def save_sharded(self, path: str, background: bool, optimizer: bool) -> None:
        """This rank's shards into the DCP directory `path` (with rank 0's); `background`:
        staged to the CPU now, written by a thread `wait_save` joins."""
        state = self.learner.sharded_state(optimizer)
        if not background:
            fsdp.save_sharded(state, path, self.ckpt_group)
            return
        self.pending = fsdp.async_save_sharded(state, path, self.ckpt_group)

    def wait_save(self) -> None:
        """Wait for the background write; its error, if any, raises here (and at the driver)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()


class DistributedTorchLearner:
    """`Learner` over W FSDP2 ranks; behaves like one TorchLearner to the loop.
    `kwargs` are TorchLearner's (`reference` included: every rank holds its shard of it)."""

    def __init__(
        self,
        world_size: int,
        placement: RankPlacement | None = None,
        device: DeviceSpec | None = None,
        **kwargs: Any,
    ) -> None:
        """`placement`: where ranks 1..W-1 run and how they meet rank 0 (default: this node);
        `device`: the accelerator kind the ranks compute on (default: this machine's), each
        rank on its `actor_train.device_mapping` entry (`rank_devices`)."""
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
        init_ray()  # no-op when the run already joined its cluster
        self._ray, self.remotes, self._placed = ray, [], None
        placement = placement or RankPlacement()
        spec = device or detect_device()
        # multi-node on accelerators: the node plan (reserved before the engines, or now)
        self._placed = placement.placed_ranks(spec.kind, world_size, 1)
        meet, self._private = placement.rendezvous()  # kept: later groups use it
        kwargs.pop("device", None)  # each rank's own
        try:
            self._start(kwargs, world_size, placement, spec, meet)
        except BaseException:
            self.close()
            raise

    def _start(
        self, kwargs: dict[str, Any], world: int, placement: RankPlacement, spec: DeviceSpec,
        meet: Rendezvous,
    ) -> None:  # fmt: skip
        """Start ranks 1..W-1, wait until all are placed, then join rank 0 (the driver)."""
        remote_cls = self._ray.remote(num_cpus=0, max_concurrency=2)(_RemoteRank)
        if self._placed is not None:
            devices = placed_devices(self._placed, spec)
            options = [{**o, **placement.rank_env(self._placed.rank_env(r, meet.host, meet.port))}
                       for r, o in enumerate(self._placed.options, start=1)]  # fmt: skip
        else:
            pinned = rank_devices(list(kwargs["train"].device_mapping), spec, world)
            devices = [where for where, _ in pinned]
            options = [{**o, **placement.rank_env(env)}
                       for o, (_, env) in zip(placement.actor_options(world - 1), pinned[1:],
                                              strict=True)]  # fmt: skip
        if self._placed is not None:
            self._placed.hand_over()  # the devices held for ranks 1..W-1, to their actors
        self.remotes = [
            remote_cls.options(**opts).remote(kwargs, rank, world, meet, spec.kind, devices[rank])
            for rank, opts in enumerate(options, start=1)
        ]
        self.ranks = placement.wait_ready(self._ray, self.remotes)  # each rank's probe
        self.watch = RankWatch(self._ray, self.remotes, self.ranks)
        placement.apply_env()
        started = [r.start.remote() for r in self.remotes]
        with self.watch:
            # Rank 0 joins last: init_process_group returns once every rank has arrived.
            self.ckpt_group = _join(0, world, meet, spec, devices[0])
            self.local = TorchLearner(**kwargs, device=devices[0], rank=0, world_size=world)
            self._ray.get(started)

    @property
    def version(self) -> int:
        return self.local.version

    def set_rank_threads(self, shares: Sequence[ThreadShare]) -> None:
        """Rank r's torch threads and cores: `shares[r]` (the budget's per-rank shares). Rank 0
        is the driver process, which the run budgets itself (`DriverThreads`)."""
        self._ray.get([r.set_threads.remote(s) for r, s in zip(self.remotes, shares[1:])])

    def step(self, groups: list[Any]) -> dict[str, float]:
        ref = self._ray.put(groups)
        pending = [r.step.remote(ref) for r in self.remotes]
        with self.watch:  # a rank that is gone: one line naming it and its node
            metrics = self.local.step(groups)
            self._ray.get(pending)  # surfaces a failed rank as an error here
        metrics["learner/world_size"] = float(len(self.remotes) + 1)
        return metrics

    def _gathered(self, tensors: Iterator[Any], what: str = "weights") -> Iterator[Any]:
        """Yield rank 0's `tensors` while every remote rank runs the same gathers (`what`, see
        `_RemoteRank.drain`). A consumer that stops early still completes them here (the ranks'
        collectives must match)."""
        pending = [r.drain.remote(what) for r in self.remotes]
        try:
            # not `yield from`: closing this generator must not close `tensors` (drained below)
            for item in tensors:  # noqa: UP028
                yield item
        finally:
            fsdp.drain(tensors)
            self._ray.get(pending)

    def weights_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors, gathered one at a time from the shards (never the whole model)."""
        return self._gathered(self.local.weights_for_sync())

    @property
    def sync_device(self) -> torch.device:
        """Rank 0's device: the full tensors are gathered there."""
        return self.local.sync_device

    def adapter_for_sync(self) -> Iterator[tuple[str, torch.Tensor]] | None:
        """The LoRA adapter's factors, gathered one at a time; None without LoRA."""
        tensors = self.local.adapter_for_sync()
        return None if tensors is None else self._gathered(tensors, "adapter")

    def save_pretrained(self, path: Any) -> None:
        pending = [r.drain.remote("export") for r in self.remotes]
        self.local.save_pretrained(path)
        self._ray.get(pending)

    def pretrained_snapshot(self) -> Callable[[Path], None] | None:
        """The HF export's tensors, gathered now onto rank 0's CPU; the writer runs later. None
        with LoRA (`save_pretrained` exports the adapter too, at once)."""
        if self.local.lora:
            return None
        tensors = self._gathered(self.local.weights_for_sync())
        return fsdp.pretrained_snapshot(self.local.model, tensors)

    def state_dict(self) -> dict[str, Any]:
        return self.local.state_dict()

    def save_sharded(
        self, path: Path, background: bool = False, optimizer: bool = True
    ) -> Callable[[], None]:
        """Every rank writes its shards of model, optimizer (unless not `optimizer`) and frozen
        reference into the DCP directory `path`. Returns the wait: done at once unless
        `background`, where the shards are staged on the CPU before this returns and the
        returned call waits for the writes (raising their error)."""
        pending = [r.save_sharded.remote(str(path), background, optimizer) for r in self.remotes]
        state = self.local.sharded_state(optimizer)
        if not background:
            fsdp.save_sharded(state, path, self.ckpt_group)
            self._ray.get(pending)
            return lambda: None
        local = fsdp.async_save_sharded(state, path, self.ckpt_group)
        self._ray.get(pending)  # every rank has staged its shards: training may go on

        def wait() -> None:
            waits = [r.wait_save.remote() for r in self.remotes]
            local.result()
            self._ray.get(waits)

        return wait

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ref = self._ray.put(state)
        pending = [r.load_state_dict.remote(ref) for r in self.remotes]
        self.local.load_state_dict(state)
        self._ray.get(pending)

    def close(self) -> None:
        for remote in getattr(self, "remotes", []):
            self._ray.kill(remote, no_restart=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if getattr(self, "_placed", None) is not None:
            self._placed.release()  # rank 0's device, held for this learner
        RankPlacement.cleanup(getattr(self, "_private", None))

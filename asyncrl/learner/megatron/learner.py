"""`megatron_train`: the Megatron-core learner behind the `Learner` protocol.

Rank 0 runs in the driver process, so weight sync (`weights_for_sync` streams full HF tensors
straight from its device into the NCCL/HCCL broadcast) stays where the loop is. Checkpoints are
sharded: every rank writes its shards of the model and optimizer into the checkpoint's
`learner/` directory by Megatron's distributed checkpointing (`dist_ckpt`), which any layout and
rank count reads back; multi-node, `output_dir` must therefore be shared (checked at start).
With `len(actor_train.device_mapping)` > 1, ranks 1..W-1 are Ray actors. Every call is
mirrored on every rank (SPMD): the other ranks join the TP all-gathers and pipeline broadcasts
of an export while rank 0 yields. One node: the ranks are pinned to the driver's, each to its
device id (the visibility variable, with Ray told not to override it), and meet in a file
store in a private (0700) directory, never on a port another local process could join.
Multi-node (`cluster.address`): placed by the node plan, whole tensor-parallel (x expert
parallel) groups per node, each rank on the accelerator Ray gave it, rank 0's held for the
driver (`asyncrl/learner/placement.py`).

The reference policy for the KL loss (`actor.use_kl_loss`) is a frozen model with the actor's
parallel layout and dtype: the `reference:` section's model (same architecture and vocabulary
as the actor, see `asyncrl.learner.megatron.reference`), else the initial actor weights. Nothing
here imports Megatron at module load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from asyncrl.config.rank_plan import node_group_size
from asyncrl.device import DeviceSpec, detect_device, device_spec, prepare_megatron_imports
from asyncrl.learner.megatron.build import bridge_class
from asyncrl.learner.megatron.reference import megatron_reference
from asyncrl.learner.megatron.worker import MegatronWorker, require_megatron
from asyncrl.learner.placed_ranks import PlacedRanks, accelerator_ids, torch_index
from asyncrl.learner.placement import RankActor, RankPlacement, RankWatch, Rendezvous

__all__ = ["MegatronLearner", "require_megatron"]

SHARDED = "sharded"  # what state_dict holds where save_sharded writes (asyncrl.checkpoint)


class _RemoteRank(RankActor):
    """Ray actor body: one Megatron rank that, once `start`ed, mirrors rank 0's calls."""

    def __init__(self, kwargs: dict, rank: int, world: int, meet: Rendezvous, kind: str,
                 resource: str | None = None) -> None:  # fmt: skip
        """`resource`: placed across nodes, the Ray resource whose device this rank takes
        (None: the one its visibility variable leaves, index 0)."""
        self.rank, self.args = rank, (kwargs, world, meet, kind, resource)

    def start(self) -> None:
        kwargs, world, meet, kind, resource = self.args
        local = 0
        if resource is not None and kind != "cpu":
            local = torch_index(accelerator_ids(resource)[0], resource)
        self.worker = MegatronWorker(**kwargs, rank=self.rank, world_size=world, init_method=meet,
                                     device=device_spec(kind), local_device=local)  # fmt: skip

    def step(self, groups: list) -> dict[str, float]:
        return self.worker.step(groups)

    def logprobs(self, groups: list) -> None:
        self.worker.logprobs(groups)  # takes part; rank 0 returns the result

    def drain_export(self) -> None:
        for _ in self.worker.export():  # takes part in the gathers; yields nothing off rank 0
            pass

    def load_hf(self, named: dict) -> None:
        self.worker.load_hf(named)

    def save_sharded(self, path: str, optimizer: bool) -> None:
        self.worker.save_sharded(path, optimizer)

    def load_sharded(self, path: str, optimizer: bool) -> None:
        self.worker.load_sharded(path, optimizer)

    def load_optimizer_state(self, ranks: list) -> None:
        self.worker.load_optimizer_state(ranks[self.rank])


class MegatronLearner:
    """`Learner` over Megatron-core; same constructor arguments as `TorchLearner`."""

    def __init__(self, model_path: str | Path, train: Any, actor: Any, algorithm: Any,
                 temperature: float, total_steps: int, seed: int = 0, reference: Any = None,
                 device: DeviceSpec | None = None,
                 placement: RankPlacement | None = None) -> None:  # fmt: skip
        """`reference`: the `reference:` section (a WorkerConfig), None: the initial actor.
        `placement`: where ranks 1..W-1 run (default: this node)."""
        device = device or detect_device()
        prepare_megatron_imports(device)  # MindSpeed before Megatron, on Ascend
        require_megatron()
        use_bridge = train.strategy_args.strategy_config.get("use_bridge", "auto")
        # Refused here, before any rank process starts (every rank checks again).
        megatron_reference(reference, model_path, train, actor, bridge_class(use_bridge) is None)
        mapping = list(train.device_mapping) or [0]
        kwargs = dict(model_path=str(model_path), train=train, actor=actor, algorithm=algorithm,
                      temperature=temperature, total_steps=total_steps, seed=seed,
                      reference=reference)  # fmt: skip
        self.model_path, self.remotes, self._ray = Path(model_path), [], None
        placement = placement or RankPlacement()
        # multi-node on accelerators (a lone rank too: its device): the node plan, reserved
        # before the engines or made now
        sa = train.strategy_args
        group = node_group_size(sa.strategy_name, sa.strategy_config)
        if placement.multinode:
            self._ray = self._init_ray()
        self._placed: PlacedRanks | None = placement.placed_ranks(device.kind, len(mapping), group)
        # Rank 0 is this process, on device mapping[0] (placed: the one held for it);
        # build.init_distributed selects it on this thread, the sync's threads from here.
        local = mapping[0]
        if self._placed is not None and device.kind != "cpu":
            local = torch_index(self._placed.rank0_device, self._placed.resource)
        self.sync_device = device.torch_device(local)
        # One host: the ranks meet in a file store in a private directory (no port a local
        # process could join); a lone rank keeps its store in memory (build.init_distributed).
        meet, self._private = placement.rendezvous() if len(mapping) > 1 else (None, None)
        try:
            placement.apply_env()
            started = self._start_remotes(kwargs, mapping, meet, device, placement)
            with self.watch:
                self.local = MegatronWorker(**kwargs, rank=0, world_size=len(mapping),
                                            init_method=meet, device=device,
                                            local_device=local)  # fmt: skip
                if started:
                    self._ray.get(started)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _init_ray() -> Any:
        import ray

        from asyncrl.net import init_ray

        init_ray()  # no-op when the run already joined its cluster
        return ray

    def _start_remotes(self, kwargs: dict, mapping: list[int], meet: Rendezvous | None,
                       dev: DeviceSpec, placement: RankPlacement) -> list:  # fmt: skip
        """Ranks 1..W-1 as Ray actors, waited until placed (each `probe`d), then started
        (`start` joins the group); returns the starts to wait for once rank 0 has joined."""
        self.watch = RankWatch(self._ray, [], [])
        if meet is None:
            return []
        self._ray = self._ray or self._init_ray()
        remote_cls = self._ray.remote(num_cpus=0)(_RemoteRank)
        world, placed = len(mapping), self._placed
        if placed is not None:
            options = [{**o, **placement.rank_env(placed.rank_env(r, meet.host, meet.port))}
                       for r, o in enumerate(placed.options, start=1)]  # fmt: skip
        else:  # one host: on the driver's node, pinned to device_mapping's ids
            options = [{**o, **placement.rank_env(dev.pinned_env(mapping[r]))}
                       for r, o in enumerate(placement.actor_options(world - 1), start=1)]  # fmt: skip
        resource = placed.resource if placed is not None else None
        if placed is not None:
            placed.hand_over()  # the devices held for ranks 1..W-1, to their actors
        self.remotes = [
            remote_cls.options(**o).remote(kwargs, rank, world, meet, dev.kind, resource)
            for rank, o in enumerate(options, start=1)
        ]
        # every rank writes its shards of a checkpoint: output_dir must be shared (multi-node)
        self.ranks = placement.wait_ready(self._ray, self.remotes, shared=True)
        self.watch = RankWatch(self._ray, self.remotes, self.ranks)
        return [r.start.remote() for r in self.remotes]

    @property
    def version(self) -> int:
        return self.local.version

    @version.setter
    def version(self, value: int) -> None:
        self.local.version = value

    def _mirror(self, method: str, *args: Any) -> list:
        if not self.remotes:
            return []
        refs = [self._ray.put(a) for a in args]
        return [getattr(r, method).remote(*refs) for r in self.remotes]

    def step(self, groups: list) -> dict[str, float]:
        pending = self._mirror("step", groups)
        with self.watch:  # a rank that is gone: one line naming it and its node
            metrics = self.local.step(groups)
            others = self._ray.get(pending) if pending else []
        for other in others:
            metrics = metrics or other  # the last pipeline stage reports
        metrics["learner/world_size"] = float(len(self.remotes) + 1)
        return metrics

    def logprobs(self, groups: list) -> torch.Tensor | None:
        """Per-token logprobs [B, R] of `groups` under the current policy (group-id order)."""
        pending = self._mirror("logprobs", groups)
        out = self.local.logprobs(groups)
        if pending:
            self._ray.get(pending)
        return out

    def weights_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors from rank 0, streamed (one parameter gathered at a time)."""
        pending = self._mirror("drain_export")
        yield from self.local.export()
        if pending:
            self._ray.get(pending)

    def save_pretrained(self, path: str | Path) -> None:
        from asyncrl.learner.megatron.weights import save_hf

        save_hf(self.weights_for_sync(), self.model_path, Path(path))

    def state_dict(self) -> dict[str, Any]:
        """Version, schedule position and the layout; the model and optimizer are "sharded":
        `save_sharded` writes them (a checkpoint's `learner/` directory)."""
        return {"version": self.version, "lr_step": self.local.lr_step, "model": SHARDED,
                "optimizer": SHARDED, "layout": self.local.optimizer_layout()}  # fmt: skip

    def save_sharded(self, path: str | Path, background: bool = False,
                     optimizer: bool = True) -> Callable[[], None]:  # fmt: skip
        """Every rank writes its shards of the model (and `optimizer` state) into `path`
        (Megatron's distributed checkpoint, `dist_ckpt`). Written before this returns, also
        when `background` (an async save): Megatron's save runs collectives on the training
        groups, which a thread must not interleave with a step's; the rest of the checkpoint
        is written in the background. Returns the (done) wait."""
        Path(path).mkdir(parents=True, exist_ok=True)  # before any rank writes into it
        pending = self._mirror("save_sharded", str(path), optimizer)
        with self.watch:
            self.local.save_sharded(str(path), optimizer)
            if pending:
                self._ray.get(pending)
        return lambda: None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A sharded save (any layout, any rank count: every rank reads its pieces), or an
        older learner.pt's full weights and per-rank optimizer states (`_load_whole`)."""
        if state.get("model") == SHARDED:
            self._load_sharded(state)
        else:
            self._load_whole(state)
        self.local.lr_step = int(state.get("lr_step", self.local.lr_step))
        self.version = int(state.get("version", self.version))

    def _load_sharded(self, state: dict[str, Any]) -> None:
        if "sharded_dir" not in state:
            raise ValueError("a sharded Megatron learner state needs its checkpoint's "
                             "directory (Checkpointer.open sets state['sharded_dir'])")  # fmt: skip
        from asyncrl.learner.megatron.optim_state import check_reshardable

        optimizer = state.get("optimizer") == SHARDED
        if optimizer:  # before any rank loads
            check_reshardable(state.get("layout"), self.local.optimizer_layout())
        path = str(state["sharded_dir"])
        pending = self._mirror("load_sharded", path, optimizer)
        with self.watch:
            self.local.load_sharded(path, optimizer)
            if pending:
                self._ray.get(pending)

    def _load_whole(self, state: dict[str, Any]) -> None:
        """Weights first (every rank loads its shards), then each rank's optimizer state, whose
        fp32 main parameters are more exact than the model's bf16 ones (same layout only)."""
        from asyncrl.learner.megatron.optim_state import check_layout

        optimizer = state.get("optimizer")
        if optimizer is not None and "ranks" not in optimizer:  # an older single-rank save
            optimizer = {"layout": None, "ranks": [[{"common": optimizer}]]}
        if optimizer is not None:
            check_layout(optimizer["layout"], self.local.optimizer_layout())  # before any load
            if len(optimizer["ranks"]) != len(self.remotes) + 1:
                check_layout({"world": len(optimizer["ranks"])}, {"world": len(self.remotes) + 1})
        if "model" in state:
            pending = self._mirror("load_hf", state["model"])
            self.local.load_hf(state["model"])
            if pending:
                self._ray.get(pending)
        if optimizer is not None:
            pending = self._mirror("load_optimizer_state", optimizer["ranks"])
            self.local.load_optimizer_state(optimizer["ranks"][0])
            if pending:
                self._ray.get(pending)

    def close(self) -> None:
        for remote in self.remotes:
            self._ray.kill(remote, no_restart=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if getattr(self, "_placed", None) is not None:
            self._placed.release()  # rank 0's device, held for this learner
        RankPlacement.cleanup(getattr(self, "_private", None))

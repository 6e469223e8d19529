"""Where a multi-rank learner's ranks 1..W-1 run, and where they meet rank 0.

Rank 0 is the driver process (the loop, weight sync and checkpoints stay there). The other
ranks are Ray actors:
- one host (no `cluster.address`): pinned to the driver's node, each on its
  `actor_train.device_mapping` entry (its environment: `DeviceSpec.pinned_env`); they meet
  rank 0 through a file store in a private (0700) directory: no port a local process could
  join or read.
- multi-node on accelerators (GPU/NPU; `asyncrl/learner/placed_ranks.py`): rank 0's device is
  reserved for the driver through Ray, so no engine or other rank is given it: the device Ray
  gave the driver (a job submitted with `--entrypoint-num-gpus 1`), else one taken on the
  driver's node by a small holder actor (its id is rank 0's device). A driver's node without
  a free accelerator (a GPU-less head) is refused before anything starts: `ray job submit
  --entrypoint-num-gpus 1 -- asyncrl run CFG` puts the driver on a GPU node. Ranks 1..W-1
  are one actor each holding one accelerator and one CPU, pinned to the node the plan gives
  it (`asyncrl/config/rank_plan.py`: consecutive ranks in whole tensor-parallel (x expert)
  groups per node, the driver's node filled first, then the fewest nodes); each computes on
  the device Ray gave it and reads its place from `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
  `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`. `actor_train.device_mapping`'s length
  is the rank count; its ids are not used (Ray's are). `ASYNCRL_RANK_ACCELERATOR=GPU`
  emulates a GPU cluster's placement on CPU ranks (tests, rehearsals).
- multi-node on the CPU: in a placement group of W-1 bundles (CPU 1 plus
  `cluster.learner_bundle`'s custom resources), PACK (as few nodes as fit).
Every actor is waited for (started, and placed) within `READY_TIMEOUT_S`, else all are removed
and `RankPlacementError` says which rank on which node is missing. Multi-node, the ranks meet
rank 0 at the driver node's address as Ray reports it (`net.advertised_host`), never
127.0.0.1, in a TCPStore that rank 0 hosts and whose every value is sealed with a fresh
per-learner secret (`weights/group.py:SealedStore`, HMAC-SHA256): the secret reaches the ranks
only in their Ray actor arguments, so a process that can reach the port but lacks it cannot
forge a rank's address or any other rendezvous value (its value fails the join, in one line).
`cluster.learner_env` (NCCL_*/HCCL_* settings) is set in every rank's environment, rank 0's
(the driver process) included; `cluster.collective_timeout_s` bounds every collective, so a
lost rank ends the run in bounded time (`LostRankError` names it and its node).
"""

from __future__ import annotations

import datetime
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.learner.placed_ranks import (
    READY_TIMEOUT_S,
    PlacedRanks,
    RankPlacementError,
    check_shared,
    place_ranks,
    rank_resource,
    shared_nonce,
)
from asyncrl.net import advertised_host, free_port, url_host

__all__ = ["LostRankError", "RankPlacement", "RankPlacementError", "Rendezvous"]

#: How long a rank waits for the others at the rendezvous.
RENDEZVOUS_TIMEOUT_S = 600.0

#: How long the driver waits for the ranks' placement group (the cluster may be scaling up).
PLACEMENT_TIMEOUT_S = READY_TIMEOUT_S
#: Default timeout of the ranks' process groups (`cluster.collective_timeout_s`).
COLLECTIVE_TIMEOUT_S = 1800.0


class LostRankError(RuntimeError):
    """A learner rank ended (its process or node is gone): the run cannot go on."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one learner meet: a file store (`host` a file:// URL, no port, no
    secret) or a TCPStore at host:port whose values are sealed with `secret` (never shown)."""

    host: str
    port: int = 0
    secret: bytes = field(default=b"", repr=False)
    timeout_s: float = COLLECTIVE_TIMEOUT_S
    """Timeout of the process group's collectives (`cluster.collective_timeout_s`)."""

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def join(self, rank: int, world: int, backend: str = "gloo") -> None:
        """Join the default process group as `rank` (rank 0 hosts a TCPStore)."""
        import torch.distributed as dist

        if self.host.startswith("file://"):
            dist.init_process_group(backend, init_method=self.host, rank=rank, world_size=world,
                                    timeout=self.timeout)  # fmt: skip
            return
        from asyncrl.weights.group import keep_alive, sealed_tcp_store

        wait = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        store = sealed_tcp_store(self.host, self.port, rank, world, self.secret, wait)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=self.timeout)  # fmt: skip
        keep_alive(dist.group.WORLD, store)  # later groups (new_group) call into it

    def url(self) -> str:
        """The rendezvous for messages: its address, never its secret."""
        return self.host if not self.port else f"tcp://{url_host(self.host)}:{self.port}"


@dataclass(frozen=True)
class RankPlacement:
    """How to place ranks 1..W-1 (see the module docstring)."""

    multinode: bool = False
    bundle: dict[str, float] = field(default_factory=dict)  # custom resources per rank
    env: dict[str, str] = field(default_factory=dict)  # cluster.learner_env
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    accelerators_per_node: tuple[int, ...] = ()  # cluster.accelerators_per_node
    shared_dir: str | None = None  # output_dir: multi-node, every rank must see it
    reserved: dict[str, Any] = field(default_factory=dict)  # "ranks": PlacedRanks (`reserve`)

    @classmethod
    def from_config(cls, cfg: Any) -> RankPlacement:
        """The placement a run's `cluster` section asks for (multi-node: `cluster.address`)."""
        cl = cfg.cluster
        return cls(
            multinode=bool(cl.address.strip()), bundle=dict(cl.learner_bundle),
            env={k: str(v) for k, v in cl.learner_env.items()},
            collective_timeout_s=float(cl.collective_timeout_s),
            accelerators_per_node=tuple(cl.accelerators_per_node),
            shared_dir=str(cfg.output_dir) if cl.address.strip() else None,
        )  # fmt: skip

    def resource(self, kind: str) -> str | None:
        """The Ray resource each rank holds one of (multi-node on accelerators), else None."""
        if not self.multinode:
            return None
        resource = rank_resource(kind)
        if resource is not None and self.bundle:
            raise RankPlacementError(
                f"cluster.learner_bundle places CPU ranks; ranks on {resource}s are placed by "
                "the node plan (asyncrl/config/rank_plan.py): remove it"
            )
        return resource

    def reserve(self, kind: str, world: int, group: int) -> PlacedRanks | None:
        """Multi-node on accelerators: plan the ranks and hold their devices now (before the
        engines are placed; a driver's node without a free device is refused here, before
        anything starts). The learner takes them over (`placed_ranks`). None otherwise."""
        resource = self.resource(kind)
        if resource is None:
            return None
        placed = self.reserved.get("ranks")
        if placed is None:
            placed = place_ranks(world, group, resource, self.accelerators_per_node)
            self.reserved["ranks"] = placed
        return placed

    def placed_ranks(self, kind: str, world: int, group: int) -> PlacedRanks | None:
        """The learner's share of `reserve` (made now if it was not): it owns them from here
        (releases them at its close)."""
        placed = self.reserve(kind, world, group)
        if placed is not None and (len(placed.slots), placed.group) != (world, group):
            placed.release()
            raise RankPlacementError(
                f"the learner's {world} ranks in groups of {group} differ from the "
                f"{len(placed.slots)} in groups of {placed.group} reserved for it"
            )
        self.reserved.pop("ranks", None)
        return placed

    def release_reserved(self) -> None:
        """Free what `reserve` holds if no learner took it over (a run that ended before)."""
        placed = self.reserved.pop("ranks", None)
        if placed is not None:
            placed.release()

    def apply_env(self) -> None:
        """`cluster.learner_env` into this process (rank 0), before its groups start."""
        os.environ.update(self.env)

    def rank_env(self, extra: dict[str, str]) -> dict[str, Any]:
        """Ray actor options giving a remote rank `cluster.learner_env` and `extra`."""
        env = {**self.env, **extra}
        return {"runtime_env": {"env_vars": env}} if env else {}

    def rendezvous_host(self) -> str:
        """Rank 0's address for a TCP rendezvous: the driver node's (multi-node), else loopback."""
        return advertised_host("0.0.0.0") if self.multinode else "127.0.0.1"

    def rendezvous(self) -> tuple[Rendezvous, str | None]:
        """(where the ranks meet, a directory to remove at close or None). Multi-node: a
        sealed TCPStore at `rendezvous_host` on a free port; one host: file:// in a fresh
        private directory."""
        timeout = self.collective_timeout_s
        if self.multinode:
            host = self.rendezvous_host()
            return Rendezvous(host, free_port(host), secrets.token_bytes(32), timeout), None
        private = tempfile.mkdtemp(prefix="asyncrl-rendezvous-")  # mode 0700
        return Rendezvous(f"file://{private}/store", timeout_s=timeout), private

    def wait_ready(
        self, ray: Any, remotes: Sequence[Any], shared: bool = True
    ) -> list[dict[str, Any]]:
        """Each remote rank's `probe` (node id, IP, devices Ray gave it, its environment):
        all started within `READY_TIMEOUT_S`, and multi-node (with `shared`: the ranks write
        to output_dir) each reads back a nonce the driver wrote there. Else every rank is
        removed and RankPlacementError says which."""
        check = shared and self.shared_dir
        path, nonce = shared_nonce(self.shared_dir) if check else ("", "")
        refs = [r.probe.remote(path, nonce, sorted(self.env)) for r in remotes]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=READY_TIMEOUT_S)
        try:
            late = [rank for rank, ref in enumerate(refs, start=1) if ref not in ready]
            if late:
                raise RankPlacementError(
                    f"learner rank(s) {late} not started within {READY_TIMEOUT_S:.0f}s "
                    "(no room on their node(s)?)"
                )
            try:
                infos = ray.get(refs)
            except Exception as e:  # an actor that failed to start
                raise RankPlacementError(f"a learner rank failed to start: {first_line(e)}") from e
            for rank, info in enumerate(infos, start=1):
                if not info["shared"]:
                    raise RankPlacementError(
                        f"output_dir {self.shared_dir} is not shared with learner rank {rank}'s "
                        f"node {info['node'][:12]} ({info['ip']}): it does not read the file the "
                        f"driver wrote there; put output_dir on a disk every node mounts at the "
                        "same path (sharded checkpoints are written by every rank)"
                    )
        except BaseException:
            for remote in remotes:
                ray.kill(remote, no_restart=True)
            raise
        return infos

    @staticmethod
    def cleanup(private: str | None) -> None:
        """Remove what `rendezvous` made (at the learner's close: later groups use the store)."""
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)

    def actor_options(self, ranks: int) -> list[dict[str, Any]]:
        """Ray actor options for each of `ranks` remote ranks, in rank order. Multi-node, the
        placement group is created here and waited for (RankPlacementError when it never
        fits); it lives as long as the job (the ranks end with the driver)."""
        import ray

        if not self.multinode:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = ray.get_runtime_context().get_node_id()
            return [
                {"scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}
                for _ in range(ranks)
            ]
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": 1.0, **self.bundle}
        pg = placement_group([dict(bundle)] * ranks, "PACK")
        if not pg.wait(PLACEMENT_TIMEOUT_S):
            ray.util.remove_placement_group(pg)
            raise RankPlacementError(  # one line
                f"no room in the Ray cluster for {ranks} learner rank bundle(s) of {bundle} "
                f"within {PLACEMENT_TIMEOUT_S:.0f}s"
            )
        # The actor takes no resources of its own: the bundle holds them, and a 0-resource
        # actor placed in it still lands on the bundle's node.
        return [
            {
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i
                )
            }
            for i in range(ranks)
        ]


class RankActor:
    """What every remote rank's Ray actor answers besides its learner's calls."""

    def probe(self, path: str, nonce: str, extra: Sequence[str] = ()) -> dict[str, Any]:
        return probe(path, nonce, extra)

    def alive(self) -> bool:
        return True


class RankWatch:
    """Turns a failure of a call that involves the remote ranks into `LostRankError` naming
    the rank and its node when one of them is gone (`with watch: ...`)."""

    def __init__(self, ray: Any, remotes: Sequence[Any], infos: Sequence[dict[str, Any]]) -> None:
        self.ray, self.remotes, self.infos = ray, remotes, infos

    def where(self, rank: int) -> str:
        info = self.infos[rank - 1]
        return f"rank {rank} on node {info['node'][:12]} ({info['ip']})"

    def __enter__(self) -> RankWatch:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if not isinstance(exc, Exception) or isinstance(exc, LostRankError) or not self.remotes:
            return
        lost = lost_rank(self.ray, self.remotes, self.where)
        if lost is not None:
            raise LostRankError(f"learner {lost} ended: {first_line(exc)}") from exc


def first_line(exc: BaseException) -> str:
    """An exception's first non-empty line (its type when it has none)."""
    return next((x.strip() for x in str(exc).splitlines() if x.strip()), type(exc).__name__)


def probe(path: str, nonce: str, extra: Sequence[str] = ()) -> dict[str, Any]:
    """A remote rank's report to the driver (its actor's `probe`): node, IP, the accelerator
    ids Ray gave it, its place in the environment (and the `extra` variables:
    `cluster.learner_env`'s), whether it reads the driver's nonce."""
    import ray

    ctx = ray.get_runtime_context()
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "CUDA_VISIBLE_DEVICES", *extra)  # fmt: skip
    return {"node": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
            "accelerators": {k: list(v) for k, v in ctx.get_accelerator_ids().items() if v},
            "env": {k: os.environ[k] for k in keys if k in os.environ},
            "pid": os.getpid(), "shared": not path or check_shared(path, nonce)}  # fmt: skip


def lost_rank(ray: Any, remotes: Sequence[Any], where: Callable[[int], str]) -> str | None:
    """`where(rank)` of the first remote rank whose actor is gone, None if none is (a rank
    still busy in a collective answers late, not with an error)."""
    refs = [r.alive.remote() for r in remotes]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10.0)
    for rank, ref in enumerate(refs, start=1):
        if ref in ready:
            try:
                ray.get(ref)
            except Exception:  # RayActorError: the process or its node is gone
                return where(rank)
    return None

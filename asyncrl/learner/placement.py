"""Where a multi-rank learner's ranks 1..W-1 run, and where they meet rank 0.

Rank 0 is the driver process (the loop, weight sync and checkpoints stay there). The other
ranks are Ray actors:
- one host (no `cluster.address`): pinned to the driver's node; they meet rank 0 through a
  file store in a private (0700) directory: no port a local process could join or read.
- multi-node: in a placement group of W-1 bundles (CPU 1 plus `cluster.learner_bundle`'s
  custom resources), PACK (as few nodes as fit), and they meet rank 0 at the driver node's
  address as Ray reports it (`net.advertised_host`), never 127.0.0.1, in a TCPStore that
  rank 0 hosts and whose every value is sealed with a fresh per-learner secret
  (`weights/group.py:SealedStore`, HMAC-SHA256): the secret reaches the ranks only in their
  Ray actor arguments, so a process that can reach the port but lacks it cannot forge a
  rank's address or any other rendezvous value (its value fails the join, in one line).
On one host, a rank on an accelerator sees only its device_mapping entry (its environment, set
by the learner: `DeviceSpec.pinned_env`). Multi-node ranks are CPU (gloo) ranks: an fsdp2_train
learner across nodes on accelerators is refused before the run starts (`asyncrl.preflight`),
a multi-device Megatron learner across nodes at validation (`config/cluster_checks.py`).
"""

from __future__ import annotations

import datetime
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

from asyncrl.net import advertised_host, free_port, url_host

#: How long a rank waits for the others at the rendezvous.
RENDEZVOUS_TIMEOUT_S = 600.0

#: How long the driver waits for the ranks' placement group (the cluster may be scaling up).
PLACEMENT_TIMEOUT_S = 300.0


class RankPlacementError(RuntimeError):
    """The cluster has no room for the learner's ranks."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one learner meet: a file store (`host` a file:// URL, no port, no
    secret) or a TCPStore at host:port whose values are sealed with `secret` (never shown)."""

    host: str
    port: int = 0
    secret: bytes = field(default=b"", repr=False)

    def join(self, rank: int, world: int, backend: str = "gloo") -> None:
        """Join the default process group as `rank` (rank 0 hosts a TCPStore)."""
        import torch.distributed as dist

        if self.host.startswith("file://"):
            dist.init_process_group(backend, init_method=self.host, rank=rank, world_size=world)
            return
        from asyncrl.weights.group import keep_alive, sealed_tcp_store

        timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        store = sealed_tcp_store(self.host, self.port, rank, world, self.secret, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        keep_alive(dist.group.WORLD, store)  # later groups (new_group) call into it

    def url(self) -> str:
        """The rendezvous for messages: its address, never its secret."""
        return self.host if not self.port else f"tcp://{url_host(self.host)}:{self.port}"


@dataclass(frozen=True)
class RankPlacement:
    """How to place ranks 1..W-1 (see the module docstring)."""

    multinode: bool = False
    bundle: dict[str, float] = field(default_factory=dict)  # custom resources per rank

    def rendezvous_host(self) -> str:
        """Rank 0's address for a TCP rendezvous: the driver node's (multi-node), else loopback."""
        return advertised_host("0.0.0.0") if self.multinode else "127.0.0.1"

    def rendezvous(self) -> tuple[Rendezvous, str | None]:
        """(where the ranks meet, a directory to remove at close or None). Multi-node: a
        sealed TCPStore at `rendezvous_host` on a free port; one host: file:// in a fresh
        private directory."""
        if self.multinode:
            host = self.rendezvous_host()
            return Rendezvous(host, free_port(host), secrets.token_bytes(32)), None
        private = tempfile.mkdtemp(prefix="asyncrl-rendezvous-")  # mode 0700
        return Rendezvous(f"file://{private}/store"), private

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
            raise RankPlacementError(
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

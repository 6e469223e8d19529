"""Where a multi-rank learner's ranks 1..W-1 run, and where they meet rank 0.

Rank 0 is the driver process (the loop, weight sync and checkpoints stay there). The other
ranks are Ray actors:
- one host (no `cluster.address`): pinned to the driver's node; they meet rank 0 through a
  file store in a private (0700) directory: no port a local process could join or read.
- multi-node: in a placement group of W-1 bundles (CPU 1 plus `cluster.learner_bundle`'s
  custom resources), PACK (as few nodes as fit), and they meet rank 0 at the driver node's
  address as Ray reports it (`net.advertised_host`), never 127.0.0.1.
The ranks placed here are CPU (gloo) ranks: a learner whose ranks need accelerators of other
nodes is refused at validation (`config/cluster_checks.py`).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

from asyncrl.net import advertised_host, free_port, url_host

#: How long the driver waits for the ranks' placement group (the cluster may be scaling up).
PLACEMENT_TIMEOUT_S = 300.0


class RankPlacementError(RuntimeError):
    """The cluster has no room for the learner's ranks."""


@dataclass(frozen=True)
class RankPlacement:
    """How to place ranks 1..W-1 (see the module docstring)."""

    multinode: bool = False
    bundle: dict[str, float] = field(default_factory=dict)  # custom resources per rank

    def rendezvous_host(self) -> str:
        """Rank 0's address for a TCP rendezvous: the driver node's (multi-node), else loopback."""
        return advertised_host("0.0.0.0") if self.multinode else "127.0.0.1"

    def rendezvous(self) -> tuple[str, str | None]:
        """(init_method for torch.distributed, a directory to remove at close or None).
        Multi-node: tcp:// at `rendezvous_host` on a free port; one host: file:// in a fresh
        private directory."""
        if self.multinode:
            host = self.rendezvous_host()
            return f"tcp://{url_host(host)}:{free_port(host)}", None
        private = tempfile.mkdtemp(prefix="asyncrl-rendezvous-")  # mode 0700
        return f"file://{private}/store", private

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
            ] * ranks
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

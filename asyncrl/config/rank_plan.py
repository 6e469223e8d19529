"""Which node each rank of a multi-node accelerator learner runs on: a pure plan (no Ray, no
torch), used at run time on the cluster's free accelerator counts
(`asyncrl/learner/placement.py`) and by `config validate` / `config show` on
`cluster.accelerators_per_node`.

Ranks are assigned consecutively, in whole groups of `group` ranks (Megatron: a tensor-parallel
group, times expert parallel; fsdp2: 1), so that no such group spans two nodes: its collectives
stay on the node's fast links. Rank 0 is the driver process, on the driver's node (listed first,
its count including rank 0's device): that node is filled first, then the fewest other nodes
(the largest first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class RankPlanError(ValueError):
    """The ranks cannot be placed on these nodes (one line naming the counts)."""


@dataclass(frozen=True)
class RankSlot:
    """Where one rank runs: `node` indexes the node list given to `plan_ranks` (0: the
    driver's); `local_rank` is its index among that node's ranks (`LOCAL_RANK`)."""

    rank: int
    node: int
    local_rank: int
    local_world_size: int


def plan_ranks(world: int, group: int, free: Sequence[int]) -> list[RankSlot]:
    """Slots of ranks 0..world-1 (rank order) on nodes with `free` accelerators each (the
    driver's node first, rank 0's device counted there). Raises RankPlanError when the ranks
    cannot be placed in whole groups of `group`."""
    if world < 1 or group < 1:
        raise RankPlanError(f"a learner of {world} rank(s) in groups of {group} cannot be planned")
    if world % group:
        raise RankPlanError(
            f"{world} learner ranks do not split into node-local groups of {group} "
            "(tensor parallel x expert parallel)"
        )
    if any(n < 0 for n in free) or not free:
        raise RankPlanError(f"free accelerators per node must be >= 0, got {list(free)}")
    if free[0] < group:
        raise RankPlanError(
            f"the driver's node has {free[0]} free accelerator(s), rank 0's group needs "
            f"{group} there (nodes' free accelerators, driver's first: {list(free)})"
        )
    # the driver's node first, then the others by capacity in whole groups (largest first:
    # fewest nodes); ties keep the given order
    order = [0] + sorted(range(1, len(free)), key=lambda i: -(free[i] // group))
    counts: dict[int, int] = {}
    left = world
    for node in order:
        take = min(free[node] // group * group, left)
        if take:
            counts[node], left = take, left - take
        if not left:
            break
    if left:
        raise RankPlanError(
            f"{world} learner ranks in node-local groups of {group} do not fit the nodes' free "
            f"accelerators {list(free)} (driver's node first): {world - left} placed"
        )
    slots: list[RankSlot] = []
    for node, count in counts.items():
        first = len(slots)
        slots += [RankSlot(first + local, node, local, count) for local in range(count)]
    return slots


def node_group_size(strategy_name: str, strategy_config: dict) -> int:
    """Ranks that must share a node: Megatron's tensor-parallel size times its expert-parallel
    size (their all-reduces and all-to-alls run every layer); 1 for fsdp2_train."""
    if strategy_name != "megatron_train":
        return 1
    tp = int(strategy_config.get("tensor_model_parallel_size", 1))
    ep = int(strategy_config.get("expert_model_parallel_size", 1))
    return tp * ep


def describe(slots: Sequence[RankSlot], devices: Sequence[Sequence[int]] | None = None) -> str:
    """One line per node: its ranks and (when known) their device ids, e.g.
    `node 0 (driver): rank 0 -> device 0, rank 1 -> device 1`."""
    lines: list[str] = []
    by_node: dict[int, list[RankSlot]] = {}
    for slot in slots:
        by_node.setdefault(slot.node, []).append(slot)
    for node, ranks in by_node.items():
        ids = devices[node] if devices is not None else [s.local_rank for s in ranks]
        where = ", ".join(f"rank {s.rank} -> device {ids[s.local_rank]}" for s in ranks)
        lines.append(f"node {node}{' (driver)' if node == 0 else ''}: {where}")
    return "\n".join(lines)

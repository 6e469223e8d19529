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
from typing import Any


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


def parallel_groups(world: int, tp: int = 1, pp: int = 1, cp: int = 1) -> dict[str, list]:
    """Megatron's rank groups in its default order (tensor parallel fastest, then context,
    data, pipeline: "tp-cp-ep-dp-pp"): rank = tp_rank + tp·(cp_rank + cp·(dp_rank + dp·pp_rank)).
    fsdp2_train: tp = pp = cp = 1, one data-parallel group of every rank."""
    dp = world // (tp * pp * cp)

    def rank(t: int, c: int, d: int, p: int) -> int:
        return t + tp * (c + cp * (d + dp * p))

    loops = [(c, d, p) for p in range(pp) for d in range(dp) for c in range(cp)]
    groups = {
        "tensor_parallel": [[rank(t, c, d, p) for t in range(tp)] for c, d, p in loops],
        "pipeline_parallel": [
            [rank(t, c, d, p) for p in range(pp)] for d in range(dp) for c in range(cp)
            for t in range(tp)
        ],
        "data_parallel": [
            [rank(t, c, d, p) for d in range(dp)] for p in range(pp) for c in range(cp)
            for t in range(tp)
        ],
    }  # fmt: skip
    if cp > 1:
        groups["context_parallel"] = [
            [rank(t, c, d, p) for c in range(cp)] for p in range(pp) for d in range(dp)
            for t in range(tp)
        ]  # fmt: skip
    return groups


def learner_placement(cfg: Any) -> dict[str, Any] | None:
    """What `config show` prints of a multi-node learner's placement, planned on
    `cluster.accelerators_per_node` (None without it or without `cluster.address`): each
    node's ranks and device slots, and the parallel groups."""
    cl, train = cfg.cluster, cfg.actor_train
    if not cl.address.strip() or not cl.accelerators_per_node:
        return None
    sa = train.strategy_args
    world, sc = len(train.device_mapping), sa.strategy_config
    slots = plan_ranks(world, node_group_size(sa.strategy_name, sc), cl.accelerators_per_node)
    if sa.strategy_name == "megatron_train":
        sizes = [int(sc.get(k) or 1) for k in ("tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "context_parallel_size")]  # fmt: skip
        groups = parallel_groups(world, *sizes)
    else:
        groups = parallel_groups(world)
    return {
        "planned_on": {"accelerators_per_node": list(cl.accelerators_per_node)},
        "nodes": describe(slots).splitlines(),
        "groups": {k: [_span(g) for g in v] for k, v in groups.items()},
    }


def _span(ranks: list[int]) -> str:
    """A group as text: "0-3" for consecutive ranks, else "0,4,8"."""
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))

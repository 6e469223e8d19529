"""A multi-node learner's ranks on accelerators: rank 0's device reserved in the driver, ranks
1..W-1 pinned to the nodes of the plan (`asyncrl/config/rank_plan.py`), each holding one
accelerator of Ray's and told its place (`RANK`, `LOCAL_RANK`, ...). See
`asyncrl/learner/placement.py` for the whole picture.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config.rank_plan import RankPlanError, RankSlot, plan_ranks

#: Emulate a GPU cluster's placement on CPU ranks: with the computing device cpu, "GPU" (or
#: "NPU") makes every rank hold one declared accelerator of that Ray resource, placed by the
#: node plan exactly as on a GPU cluster, while the ranks compute on the CPU over gloo. For
#: tests and rehearsals on CPU clusters (`ray start --num-gpus N`); ignored on an accelerator.
RANK_ACCELERATOR_ENV = "ASYNCRL_RANK_ACCELERATOR"
#: Set by Ray in a job's entrypoint process (`ray job submit`).
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
VISIBILITY = {"GPU": "CUDA_VISIBLE_DEVICES", "NPU": "ASCEND_RT_VISIBLE_DEVICES"}
#: How long the rank actors (and rank 0's holder) may take to be placed and start.
READY_TIMEOUT_S = 300.0
#: The file the driver writes under output_dir and every remote rank reads back.
SHARED_CHECK = ".asyncrl-shared-check"


class RankPlacementError(RuntimeError):
    """The cluster has no room for the learner's ranks (or cannot serve them)."""


def rank_resource(kind: str) -> str | None:
    """The Ray resource each rank holds one of: the device's (GPU, NPU); on the CPU none,
    unless `ASYNCRL_RANK_ACCELERATOR` asks to emulate a GPU cluster's placement."""
    if kind == "cuda":
        return "GPU"
    if kind == "npu":
        return "NPU"
    wanted = os.environ.get(RANK_ACCELERATOR_ENV, "").strip()
    if wanted and wanted not in VISIBILITY:
        raise RankPlacementError(
            f"{RANK_ACCELERATOR_ENV}={wanted!r}: expected GPU or NPU (or unset)"
        )
    return wanted or None


def _resource_option(resource: str) -> dict[str, Any]:
    return {"num_gpus": 1} if resource == "GPU" else {"resources": {resource: 1}}


def torch_index(device_id: int, resource: str) -> int:
    """The torch index of Ray's device `device_id` in this process (its position in the
    visibility variable; the id itself when the process sees every device)."""
    visible = os.environ.get(VISIBILITY[resource], "").strip()
    if not visible:
        return device_id
    ids = [v.strip() for v in visible.split(",")]
    if str(device_id) not in ids:
        raise RankPlacementError(
            f"device {device_id} is not visible to this process ({VISIBILITY[resource]}={visible})"
        )
    return ids.index(str(device_id))


def accelerator_ids(resource: str) -> list[int]:
    """The ids of `resource` Ray gave the calling actor."""
    import ray

    return [int(i) for i in ray.get_runtime_context().get_accelerator_ids().get(resource, [])]


class _Holder:
    """Ray actor body: holds rank 0's accelerator for the driver while the learner lives."""

    def ids(self, resource: str) -> list[int]:
        return accelerator_ids(resource)


@dataclass
class PlacedRanks:
    """Where each rank runs (`slots`, rank order), on which node (`nodes[slot.node]`: (node
    id, IP)), rank 0's Ray device id, and the Ray options of ranks 1..W-1."""

    slots: list[RankSlot]
    nodes: list[tuple[str, str]]
    rank0_device: int
    resource: str
    holder: Any = None
    options: list[dict[str, Any]] = field(default_factory=list)
    holders: list[Any] = field(default_factory=list)
    """Placeholders of ranks 1..W-1's devices until their actors start (`hand_over`)."""
    group: int = 1

    def hand_over(self) -> None:
        """Free the devices held for ranks 1..W-1: their actors, pinned to the same nodes,
        take them next (engines were placed meanwhile; nothing else asks for devices)."""
        import ray

        for holder in self.holders:
            ray.kill(holder, no_restart=True)
        self.holders = []

    def where(self, rank: int) -> str:
        node_id, ip = self.nodes[self.slots[rank].node]
        return f"rank {rank} on node {node_id[:12]} ({ip})"

    def rank_env(self, rank: int, master: str, port: int) -> dict[str, str]:
        """What torch and Megatron read of a rank's place (the device is Ray's)."""
        slot = self.slots[rank]
        return {"RANK": str(rank), "WORLD_SIZE": str(len(self.slots)),
                "LOCAL_RANK": str(slot.local_rank),
                "LOCAL_WORLD_SIZE": str(slot.local_world_size),
                "MASTER_ADDR": master, "MASTER_PORT": str(port)}  # fmt: skip

    def release(self) -> None:
        import ray

        self.hand_over()
        if self.holder is not None:
            ray.kill(self.holder, no_restart=True)
            self.holder = None


def _driver_node(ray: Any) -> tuple[str, dict[str, float]]:
    here = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == here)
    return here, node


def _gpuless(resource: str, why: str) -> RankPlacementError:
    return RankPlacementError(
        f"the driver's node {why} {resource} for learner rank 0 (the driver process): run the "
        f"driver on a {resource} node, e.g. `ray job submit --entrypoint-num-gpus 1 -- "
        "asyncrl run CFG`"
    )


def reserve_rank0(resource: str) -> tuple[int, Any]:
    """(rank 0's Ray device id, the holder actor or None). A driver Ray started with a device
    (a job's entrypoint given one) uses it; else a holder actor on this node takes one, so
    neither engines nor other ranks are given it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    visible = os.environ.get(VISIBILITY[resource], "").strip()
    if os.environ.get(RAY_JOB_ENV) and visible:
        return int(visible.split(",")[0]), None
    here, node = _driver_node(ray)
    if node["Resources"].get(resource, 0) < 1:
        raise _gpuless(resource, "has no")
    if not _freed(ray, here, resource):
        raise _gpuless(resource, "has no free")
    holder = (
        ray.remote(num_cpus=0, **_resource_option(resource))(_Holder)
        .options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False))
        .remote()
    )
    ref = holder.ids.remote(resource)
    ready, _ = ray.wait([ref], timeout=READY_TIMEOUT_S)
    if not ready:
        ray.kill(holder, no_restart=True)
        raise _gpuless(resource, f"gave no free (within {READY_TIMEOUT_S:.0f}s)")
    return ray.get(ref)[0], holder


#: How long a device Ray shows taken may still be on its way back (an actor killed just
#: before, e.g. the previous learner's holder: Ray frees its resources asynchronously).
RELEASE_GRACE_S = 15.0


def _freed(ray: Any, node: str, resource: str) -> bool:
    """Whether `node` has a free `resource`, waiting up to RELEASE_GRACE_S for one."""
    import threading
    import time

    deadline, tick = time.monotonic() + RELEASE_GRACE_S, threading.Event()
    while _available(ray).get(node, {}).get(resource, 0) < 1:
        if time.monotonic() > deadline:
            return False
        tick.wait(0.2)
    return True


def _available(ray: Any) -> dict[str, dict[str, float]]:
    """Free resources per node id. Ray has no public per-node view; its state API's is used."""
    from ray._private.state import available_resources_per_node

    return available_resources_per_node()


def free_accelerators(resource: str, held: bool) -> tuple[list[str], list[int]]:
    """(node ids, free `resource` of each), the driver's node first with rank 0's device
    counted there; the other alive nodes that have any, by node id. `held`: a holder of this
    learner's took rank 0's device (its node's count then waits until Ray shows it taken)."""
    import threading
    import time

    import ray

    here, node = _driver_node(ray)
    total = int(node["Resources"].get(resource, 0))
    tick, deadline = threading.Event(), time.monotonic() + 20.0
    free = _available(ray)
    # the free counts come from the nodes' reports: until the holder's device shows taken,
    # the driver's node would be counted one device too many
    while held and free.get(here, {}).get(resource, 0) >= total and time.monotonic() < deadline:
        tick.wait(0.2)
        free = _available(ray)
    alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
    ids = [here] + [n for n in alive if free.get(n, {}).get(resource, 0) >= 1]
    counts = [int(free.get(n, {}).get(resource, 0)) for n in ids]
    counts[0] += 1  # rank 0's device, held for the driver
    return ids, counts


def place_ranks(world: int, group: int, resource: str, expected: Sequence[int] = ()) -> PlacedRanks:
    """Reserve rank 0's device, plan ranks 0..world-1 on the nodes' free `resource` in
    node-local groups of `group`, and make each remote rank's Ray options (one `resource`,
    one CPU, pinned to its node). `expected` (`cluster.accelerators_per_node`): the counts the
    config planned on; a live plan that places ranks otherwise is refused."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    rank0, holder = reserve_rank0(resource)
    try:
        ids, free = free_accelerators(resource, holder is not None)
        try:
            slots = plan_ranks(world, group, free)
        except RankPlanError as e:
            raise RankPlacementError(str(e)) from None
        _check_expected(slots, world, group, free, expected)
    except BaseException:
        if holder is not None:
            ray.kill(holder, no_restart=True)
        raise
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    placed = PlacedRanks(slots, [(i, ips[i]) for i in ids], rank0, resource, holder, group=group)
    pins = [NodeAffinitySchedulingStrategy(ids[s.node], soft=False) for s in slots[1:]]
    placed.options = [
        {"num_cpus": 1, **_resource_option(resource), "scheduling_strategy": pin} for pin in pins
    ]
    try:
        _hold_devices(ray, placed, pins)
    except BaseException:
        placed.release()
        raise
    return placed


def _hold_devices(ray: Any, placed: PlacedRanks, pins: list[Any]) -> None:
    """Hold each remote rank's device on its planned node until `hand_over`, so the engines
    (placed between the plan and the learner's start) take other devices."""
    holder_cls = ray.remote(num_cpus=0, **_resource_option(placed.resource))(_Holder)
    placed.holders = [holder_cls.options(scheduling_strategy=pin).remote() for pin in pins]
    refs = [h.ids.remote(placed.resource) for h in placed.holders]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=READY_TIMEOUT_S)
    if len(ready) < len(refs):
        late = [r for r, ref in enumerate(refs, start=1) if ref not in ready]
        raise RankPlacementError(
            f"learner rank(s) {late}: no {placed.resource} free on their planned node(s) "
            f"within {READY_TIMEOUT_S:.0f}s"
        )


def _check_expected(
    slots: list[RankSlot], world: int, group: int, free: list[int], expected: Sequence[int]
) -> None:
    if not expected:
        return
    per_node = [sum(1 for s in slots if s.node == n) for n in range(len(free))]
    want = [sum(1 for s in plan_ranks(world, group, expected) if s.node == n)
            for n in range(len(expected))]  # fmt: skip
    if sorted(n for n in per_node if n) != sorted(n for n in want if n) or per_node[0] != want[0]:
        raise RankPlacementError(
            f"cluster.accelerators_per_node {list(expected)} places {world} learner ranks "
            f"{[n for n in want if n]} per node; the cluster's free accelerators {free} place "
            f"them {[n for n in per_node if n]}: correct cluster.accelerators_per_node"
        )


def shared_nonce(output_dir: str | Path) -> tuple[str, str]:
    """(path, nonce): a fresh nonce written under `output_dir` for the remote ranks to read
    back (`check_shared`): their nodes must see the driver's output_dir (sharded checkpoints)."""
    path = Path(output_dir) / SHARED_CHECK
    path.parent.mkdir(parents=True, exist_ok=True)
    nonce = secrets.token_hex(16)
    path.write_text(nonce)
    return str(path), nonce


def check_shared(path: str, nonce: str) -> bool:
    """Whether this process reads `nonce` at `path` (the driver's output_dir is shared)."""
    try:
        return Path(path).read_text() == nonce
    except OSError:
        return False

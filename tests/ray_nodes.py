"""A real two-node Ray cluster on this one machine (`ray.cluster_utils.Cluster`: two raylets
with distinct node ids), on the machine's address rather than loopback, for the multi-node
tests: the head carries the custom resource `node_a`, the worker `node_b`; GPUs may be
declared on both (Ray then schedules them and hands out their ids as on GPU nodes)."""

from __future__ import annotations

from typing import Any


def two_node_cluster(cpus: int, gpus: int = 0) -> Any:
    """The started cluster (its nodes up), each node with `cpus` CPUs and `gpus` GPUs."""
    from ray.cluster_utils import Cluster

    from asyncrl.net import _ray_cluster_mode

    _ray_cluster_mode()  # nodes on the machine's address, not loopback
    head = {"num_cpus": cpus, "resources": {"node_a": 1}, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={**head, "num_gpus": gpus})
    cluster.add_node(num_cpus=cpus, num_gpus=gpus, resources={"node_b": 1})
    cluster.wait_for_nodes()
    return cluster

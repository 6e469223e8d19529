"""The node plan of a multi-node accelerator learner (`asyncrl/config/rank_plan.py`), pure: no
tensor-parallel group spans two nodes, the driver's node is filled first, then the fewest
nodes; what cannot be placed is refused in one line naming the counts. And the cluster keys
that place the learner: validated in one line, planned by `config show`."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import yaml

from asyncrl.config import load_config
from asyncrl.config.rank_plan import RankPlanError, describe, node_group_size, plan_ranks
from asyncrl.config.schema import ConfigError

MULTINODE = ("cluster.address=auto", "cluster.bind_host=0.0.0.0", "rollout.transport_host=0.0.0.0")


def _per_node(slots) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for s in slots:
        out.setdefault(s.node, []).append(s.rank)
    return out


def test_two_per_node():
    slots = plan_ranks(4, 1, [2, 2])
    assert [(s.rank, s.node, s.local_rank, s.local_world_size) for s in slots] == [
        (0, 0, 0, 2), (1, 0, 1, 2), (2, 1, 0, 2), (3, 1, 1, 2),
    ]  # fmt: skip


def test_the_driver_node_first_then_the_fewest_nodes():
    # the driver's 3 take one group of 2; then the 4-node (one node) before two 2-nodes
    assert _per_node(plan_ranks(6, 2, [3, 2, 4, 2])) == {0: [0, 1], 2: [2, 3, 4, 5]}
    # a spare driver node takes everything
    assert _per_node(plan_ranks(4, 2, [8, 8])) == {0: [0, 1, 2, 3]}


@pytest.mark.parametrize("group", [1, 2, 4])
def test_groups_never_span_nodes(group):
    """Every feasible count vector: each group of `group` consecutive ranks lies on one node,
    ranks are consecutive per node, and no node holds more than it has free."""
    for free in itertools.product(range(0, 6), repeat=3):
        for world in (group, 2 * group, 4 * group):
            try:
                slots = plan_ranks(world, group, list(free))
            except RankPlanError as e:
                assert "\n" not in str(e)
                continue
            assert [s.rank for s in slots] == list(range(world)) and slots[0].node == 0
            for first in range(0, world, group):
                assert len({s.node for s in slots[first : first + group]}) == 1
            for node, ranks in _per_node(slots).items():
                assert len(ranks) <= free[node] and ranks == list(range(ranks[0], ranks[-1] + 1))


@pytest.mark.parametrize(
    "world, group, free, message",
    [
        (4, 2, [1, 8], "the driver's node has 1 free accelerator(s), rank 0's group needs 2"),
        (4, 1, [0, 8], "the driver's node has 0 free accelerator(s)"),
        (8, 2, [2, 3, 3], "do not fit the nodes' free accelerators [2, 3, 3]"),
        (6, 4, [8, 8], "do not split into node-local groups of 4"),
        (2, 1, [2, -1], "must be >= 0"),
    ],
)
def test_what_cannot_be_placed_is_refused_naming_the_counts(world, group, free, message):
    with pytest.raises(RankPlanError, match=re.escape(message)) as e:
        plan_ranks(world, group, free)
    assert "\n" not in str(e.value)


def test_group_size_is_tensor_times_expert_parallel():
    assert node_group_size("fsdp2_train", {"tensor_model_parallel_size": 4}) == 1
    sc = {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 4}
    assert node_group_size("megatron_train", sc) == 8
    assert node_group_size("megatron_train", {}) == 1


def test_describe_names_each_rank_on_its_node_and_device():
    text = describe(plan_ranks(4, 2, [2, 2]))
    assert text.splitlines() == [
        "node 0 (driver): rank 0 -> device 0, rank 1 -> device 1",
        "node 1: rank 2 -> device 0, rank 3 -> device 1",
    ]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster.learner_env={NCCL_SOCKET_IFNAME: eth0, RANK: '3'}"],
         "cluster.learner_env.RANK is set by asyncrl"),
        (["cluster.learner_env={'BAD NAME': x}"], "is not an environment variable name"),
        (["cluster.collective_timeout_s=0"], "cluster.collective_timeout_s must be a number"),
        (["cluster.collective_timeout_s=.inf"], "cluster.collective_timeout_s must be a finite"),
        (["cluster.accelerators_per_node=[8, -1]"], "must list ints >= 0"),
        (["cluster.accelerators_per_node=[8, 8]"], "accelerators_per_node places parts"),
        ([*MULTINODE, "cluster.accelerators_per_node=[1, 8]", "actor_train.device_mapping=[0,1]",
          "actor_train.strategy_args.strategy_name=megatron_train",
          "actor_train.strategy_args.strategy_config={tensor_model_parallel_size: 2}"],
         "cluster.accelerators_per_node: the driver's node has 1 free"),
    ],
)  # fmt: skip
def test_cluster_learner_keys_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)


def test_a_multinode_megatron_learner_validates():
    """Megatron over 4 devices of a cluster: placed by the node plan (no longer refused)."""
    cfg = load_config(None, [
        *MULTINODE, "actor_train.device_mapping=[0,1,2,3]",
        "actor_train.strategy_args.strategy_name=megatron_train",
        "actor_train.strategy_args.strategy_config={tensor_model_parallel_size: 2}",
        "cluster.accelerators_per_node=[2, 2]", "cluster.learner_env={NCCL_SOCKET_IFNAME: eth0}",
    ])  # fmt: skip
    assert cfg.cluster.learner_env == {"NCCL_SOCKET_IFNAME": "eth0"}


def test_the_32b_recipe_validates_and_show_prints_its_learner_placement(capsys):
    """The 4-node recipe: 16 Megatron ranks (TP 4 x PP 2 x DP 2) planned on 8 GPUs per node:
    ranks 0-7 on the driver's node, 8-15 on the next, every TP group inside one node."""
    from asyncrl.cli import main

    recipe = Path(__file__).parents[1] / "configs" / "qwen2.5-32b-math-sglang-megatron-4nodes.yaml"
    assert main(["config", "validate", str(recipe)]) == 0
    assert main(["config", "show", str(recipe)]) == 0
    text = capsys.readouterr().out
    shown = yaml.safe_load(text.split("# learner placement", 1)[1].split("\n", 1)[1])
    placement = shown["learner_placement"]
    assert placement["nodes"][0].startswith("node 0 (driver): rank 0 -> device 0, rank 1 ->")
    assert placement["nodes"][1].startswith("node 1: rank 8 -> device 0,")
    assert len(placement["nodes"]) == 2
    groups = placement["groups"]
    assert groups["tensor_parallel"] == ["0-3", "4-7", "8-11", "12-15"]
    assert groups["pipeline_parallel"][0] == "0,8" and groups["data_parallel"][0] == "0,4"


def test_a_driver_ray_gave_a_gpu_uses_it_for_rank_0(monkeypatch):
    """Submitted as a Ray job with an entrypoint GPU (Ray sets the job's variable and the
    visibility), the driver's own GPU is rank 0's: no holder is made."""
    from asyncrl.learner.placed_ranks import RAY_JOB_ENV, reserve_rank0, torch_index

    monkeypatch.setenv(RAY_JOB_ENV, "{}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert reserve_rank0("GPU") == (5, None)
    assert torch_index(5, "GPU") == 0  # the driver's only visible device
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2,3")
    assert reserve_rank0("NPU") == (2, None) and torch_index(3, "NPU") == 1

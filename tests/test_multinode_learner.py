"""A multi-rank learner placed across the nodes of a real two-node Ray cluster on this machine
(`ray.cluster_utils.Cluster`), each node declaring 2 GPUs: Ray schedules the GPUs and sets
each rank actor's accelerator ids and CUDA_VISIBLE_DEVICES as on a GPU node, while the ranks
compute on the CPU over gloo (`ASYNCRL_RANK_ACCELERATOR=GPU`, the documented emulation of a
GPU cluster's placement). Nothing else is faked: the planner, the holder of rank 0's device,
the pinned actors, the sealed rendezvous at the driver node's address and FSDP2 all run.
A killed rank and a whole run through `asyncrl.run` take minutes on a 2-core box: `slow`.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from asyncrl.checkpoint import Checkpointer
from asyncrl.learner import lora
from asyncrl.learner.placed_ranks import RANK_ACCELERATOR_ENV, RankPlacementError
from asyncrl.learner.placement import LostRankError, RankPlacement
from asyncrl.learner.torch.distributed import DistributedTorchLearner
from asyncrl.net import is_loopback
from tests.test_torch_learner import _groups, _learner


@pytest.fixture(scope="module")
def gpu_nodes():
    """A head (node_a) and a worker (node_b) node, each with 3 CPUs and 2 declared GPUs."""
    import ray

    from asyncrl.net import init_ray
    from tests.ray_nodes import two_node_cluster

    ray.shutdown()  # a local Ray left by another test module
    cluster = two_node_cluster(cpus=3, gpus=2)
    init_ray(cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def emulated_gpus(monkeypatch):
    monkeypatch.setenv(RANK_ACCELERATOR_ENV, "GPU")


def _placement(out, **kw) -> RankPlacement:
    return RankPlacement(multinode=True, shared_dir=str(out), collective_timeout_s=60.0, **kw)


def _kwargs(single, model_dir) -> dict:
    return {"model_path": model_dir, "train": single.train, "actor": single.actor,
            "algorithm": single.algorithm, "temperature": 0.7, "total_steps": 10}  # fmt: skip


def _node_ids() -> tuple[str, str]:
    import ray

    head = next(n["NodeID"] for n in ray.nodes() if "node_a" in n["Resources"])
    worker = next(n["NodeID"] for n in ray.nodes() if "node_b" in n["Resources"])
    return head, worker


def _same_weights(dist, single) -> None:
    ref = single.model.state_dict()
    gathered = dict(dist.weights_for_sync())
    assert gathered.keys() == ref.keys() - lora.tied_copies(single.model)
    for name, p in gathered.items():
        torch.testing.assert_close(p, ref[name], atol=1e-5, rtol=1e-4, msg=name)


def test_four_ranks_on_two_nodes_match_one_process(tiny_model, tmp_path, gpu_nodes, emulated_gpus):
    """fsdp2_train on 4 ranks, 2 per node: rank 0 (the driver) on the GPU its holder took,
    ranks 1..3 each on one Ray GPU of its planned node with its LOCAL_RANK, meeting rank 0 at
    the driver node's routable address; two steps equal one process's; a sharded checkpoint
    then resumes onto 3 ranks (2 + 1) and the next step still equals one process's."""
    single = _learner(tiny_model)
    batches = [_groups(n_groups=2, n=3, seed=seed) for seed in (0, 1, 2)]
    expected = [single.step(groups) for groups in batches[:2]]
    head, worker = _node_ids()
    dist = DistributedTorchLearner(4, _placement(tmp_path), **_kwargs(single, tiny_model))
    try:
        placed = dist._placed
        assert [s.node for s in placed.slots] == [0, 0, 1, 1]
        assert placed.holder is not None and placed.rank0_device in (0, 1)
        ranks = dist.ranks  # each remote rank's own report
        assert [r["node"] for r in ranks] == [head, worker, worker]
        gpus = [int(r["accelerators"]["GPU"][0]) for r in ranks]
        assert gpus[0] == 1 - placed.rank0_device  # the head's other GPU
        assert sorted(gpus[1:]) == [0, 1]  # the worker's two
        assert [r["env"]["LOCAL_RANK"] for r in ranks] == ["1", "0", "1"]
        assert all(r["env"]["LOCAL_WORLD_SIZE"] == "2" for r in ranks)
        assert [r["env"]["RANK"] for r in ranks] == ["1", "2", "3"]
        assert [r["env"]["CUDA_VISIBLE_DEVICES"] for r in ranks] == [str(g) for g in gpus]
        master = {r["env"]["MASTER_ADDR"] for r in ranks}
        assert len(master) == 1 and not is_loopback(master.pop())
        for groups, want in zip(batches, expected, strict=False):
            got = dist.step(groups)
            assert got["learner/world_size"] == 4.0
            assert got["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], abs=1e-5)
        _same_weights(dist, single)
        saved = Checkpointer(tmp_path / "ckpt", ["model", "optimizer"]).save(2, dist, {})
    finally:
        dist.close()
    want = single.step(batches[2])
    resumed = DistributedTorchLearner(3, _placement(tmp_path), **_kwargs(single, tiny_model))
    try:
        assert [s.node for s in resumed._placed.slots] == [0, 0, 1]
        assert [r["node"] for r in resumed.ranks] == [head, worker]
        Checkpointer.open(saved).apply(resumed, {"model", "optimizer"})
        got = resumed.step(batches[2])
        assert got["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], abs=1e-5)
        _same_weights(resumed, single)
    finally:
        resumed.close()


@pytest.mark.slow
def test_a_killed_rank_ends_the_step_naming_it_and_its_node(
    tiny_model, tmp_path, gpu_nodes, emulated_gpus
):
    """Rank 2 (on the worker node) is killed -9 after a step: the next step fails within the
    collective timeout, in one line naming rank 2 and its node."""
    import ray

    single = _learner(tiny_model)
    dist = DistributedTorchLearner(3, _placement(tmp_path), **_kwargs(single, tiny_model))
    try:
        dist.step(_groups(seed=0))
        _, worker = _node_ids()
        info = dist.ranks[1]
        assert info["node"] == worker
        os.kill(info["pid"], signal.SIGKILL)
        done, failure = threading.Event(), []

        def step() -> None:
            try:
                dist.step(_groups(seed=1))
            except Exception as e:  # what the run would see
                failure.append(e)
            done.set()

        threading.Thread(target=step, daemon=True).start()
        assert done.wait(timeout=120), "the step did not end after its rank was killed"
        assert failure and isinstance(failure[0], LostRankError), failure
        line = str(failure[0])
        assert "\n" not in line and f"rank 2 on node {worker[:12]} ({info['ip']})" in line
        assert ray.util.get_node_ip_address() == info["ip"]  # one machine: the same IP
    finally:
        dist.close()


def test_an_output_dir_a_rank_cannot_read_is_refused(
    tiny_model, tmp_path, gpu_nodes, emulated_gpus, monkeypatch
):
    """The remote ranks read back the nonce the driver writes under output_dir; a rank whose
    node sees another disk (here: the file it is pointed at does not exist there) refuses the
    learner in one line naming output_dir, the rank and its node, before any group starts."""
    from asyncrl.learner import placement as pl

    monkeypatch.setattr(pl, "shared_nonce", lambda out: (str(tmp_path / "elsewhere"), "n"))
    single = _learner(tiny_model)
    with pytest.raises(RankPlacementError, match="is not shared with learner rank 1") as e:
        DistributedTorchLearner(2, _placement(tmp_path), **_kwargs(single, tiny_model))
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)


def test_a_driver_node_without_a_free_gpu_is_refused_with_the_way_to_run(gpu_nodes, emulated_gpus):
    """Both of the driver node's GPUs taken (by two actors): rank 0's device cannot be
    reserved, and one line says how to put the driver on a GPU node (a Ray job given one)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from asyncrl.learner.placed_ranks import reserve_rank0

    @ray.remote(num_cpus=0, num_gpus=1)
    class Taker:
        def ready(self) -> bool:
            return True

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    takers = [Taker.options(scheduling_strategy=here).remote() for _ in range(2)]
    try:
        assert ray.get([t.ready.remote() for t in takers], timeout=60)
        with pytest.raises(RankPlacementError) as e:
            reserve_rank0("GPU")
    finally:
        for t in takers:
            ray.kill(t, no_restart=True)
    line = str(e.value)
    assert "\n" not in line and "has no free GPU" in line
    assert "ray job submit --entrypoint-num-gpus 1 -- asyncrl run CFG" in line


def test_a_device_released_just_before_is_taken_again(gpu_nodes, emulated_gpus):
    """A learner built right after another was closed (a bench, a resumed run in one process):
    Ray frees the old holder's device asynchronously, and the new rank 0 waits for it rather
    than refusing the node as GPU-less."""
    import ray

    from asyncrl.learner.placed_ranks import reserve_rank0

    first, holder_a = reserve_rank0("GPU")
    second, holder_b = reserve_rank0("GPU")  # the head's two GPUs are now held
    try:
        for _ in range(3):
            ray.kill(holder_b, no_restart=True)
            again, holder_b = reserve_rank0("GPU")
            assert again == second and again != first
    finally:
        for holder in (holder_a, holder_b):
            ray.kill(holder, no_restart=True)


@pytest.mark.slow
def test_a_run_places_its_learner_on_both_nodes_before_the_engines(
    tiny_model, tmp_path, gpu_nodes, emulated_gpus
):
    """`asyncrl run` with `cluster.address`, fsdp2_train on 3 ranks: the run reserves the
    ranks' GPUs (2 on the driver's node, 1 on the other) before its engines are placed, and
    trains through them; `cluster.learner_env` reaches every rank."""
    import json

    from asyncrl.engine.placement import PlacedLauncher
    from asyncrl.learner.placement import RankPlacement
    from asyncrl.run import run
    from tests.test_multinode import shrunk

    seen: dict[str, list] = {"reserved": [], "ranks": [], "order": []}
    reserve, wait_ready = RankPlacement.reserve, RankPlacement.wait_ready
    launch = PlacedLauncher.launch

    def recording_reserve(self, kind, world, group):
        placed = reserve(self, kind, world, group)
        seen["reserved"].append([s.node for s in placed.slots])
        seen["order"].append("learner")
        return placed

    def recording_launch(self, index, port=None):
        seen["order"].append("engine")
        return launch(self, index, port)

    def recording_wait(self, ray, remotes, shared=True):
        seen["ranks"] += wait_ready(self, ray, remotes, shared)
        return seen["ranks"]

    mp = pytest.MonkeyPatch()
    mp.setattr(RankPlacement, "reserve", recording_reserve)
    mp.setattr(RankPlacement, "wait_ready", recording_wait)
    mp.setattr(PlacedLauncher, "launch", recording_launch)
    extra = ("actor_train.device_mapping=[0,1,2]", "cluster.learner_env={NCCL_DEBUG: WARN}",
             "cluster.accelerators_per_node=[2,2]")  # fmt: skip
    try:
        summary = run(shrunk(tiny_model, tmp_path, gpu_nodes.address, *extra))
    finally:
        mp.undo()
    head, worker = _node_ids()
    assert seen["reserved"][0] == [0, 0, 1]
    assert seen["order"][0] == "learner" and "engine" in seen["order"]  # before the engines
    assert [r["node"] for r in seen["ranks"]] == [head, worker]
    assert all(r["env"]["NCCL_DEBUG"] == "WARN" for r in seen["ranks"])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("version") is not None]
    assert rows[-1]["version"] == 3 and summary["groups_trained"] == 6
    assert all(r["learner/world_size"] == 3.0 for r in rows)


@pytest.mark.slow
def test_a_run_that_loses_a_rank_ends_naming_it_and_resumes_from_its_last_checkpoint(
    tiny_model, tmp_path, gpu_nodes, emulated_gpus
):
    """A whole run (fsdp2_train, ranks on both nodes, a checkpoint every 2 steps) whose rank on
    the other node is killed -9 once its first checkpoint is complete: the run ends within the
    collective timeout with `LostRankError` naming that rank and node; `resume: auto` then
    continues from the newest complete checkpoint and trains to its end on both nodes."""
    import json

    from asyncrl.checkpoint import CHECKPOINT_DIR, Checkpointer
    from asyncrl.run import run
    from tests.helpers import wait_for
    from tests.test_multinode import shrunk

    ranks: list[dict] = []
    wait_ready = RankPlacement.wait_ready

    def recording_wait(self, ray, remotes, shared=True):
        ranks[:] = wait_ready(self, ray, remotes, shared)
        return ranks

    base = ("actor_train.device_mapping=[0,1,2]", "cluster.accelerators_per_node=[2,2]",
            "cluster.collective_timeout_s=60", "actor.checkpoint.save_interval=2")  # fmt: skip
    first = tmp_path / CHECKPOINT_DIR / "step_2"
    killed: list[dict] = []

    def kill_after_first_checkpoint() -> None:
        wait_for(lambda: first.is_dir() and ranks, "the first checkpoint", timeout_s=600)
        killed.append(ranks[-1])
        os.kill(ranks[-1]["pid"], signal.SIGKILL)

    mp = pytest.MonkeyPatch()
    mp.setattr(RankPlacement, "wait_ready", recording_wait)
    killer = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
    killer.start()
    try:
        with pytest.raises(LostRankError) as lost:  # 40 steps: it cannot end before the kill
            run(shrunk(tiny_model, tmp_path, gpu_nodes.address, *base, "max_steps=40"))
        _, worker = _node_ids()
        assert killed and killed[0]["node"] == worker
        assert f"rank 2 on node {worker[:12]}" in str(lost.value)
        assert "\n" not in str(lost.value)
        newest, _ = Checkpointer(tmp_path, ["model", "optimizer", "extra"]).find("auto")
        assert newest is not None and newest.step >= 2
        end = newest.step + 2
        resumed = shrunk(tiny_model, tmp_path, gpu_nodes.address, *base, f"max_steps={end}",
                         "actor.checkpoint.resume=auto")  # fmt: skip
        summary = run(resumed)
    finally:
        mp.undo()
    assert [r["node"] for r in ranks][-1] == worker  # the resumed run placed a rank there again
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r.get("version") is not None]
    assert steps[-1] == end and newest.step + 1 in steps  # continued where the checkpoint was
    assert summary["groups_trained"] > 0

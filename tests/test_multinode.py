"""Multi-node placement on a real two-node Ray cluster on this one machine
(`ray.cluster_utils.Cluster`: two raylets with distinct node ids and custom resources).

The run is real (hf engines as placed Ray actors, rollout workers in their bundles, ZMQ over
CURVE on a routable bind, gloo weight sync through a TCPStore on the driver node's address);
the test only records where things landed (it wraps the launcher and the pool, calling the
real ones). On one machine both nodes share an IP, so "not loopback" is asserted against the
address Ray reports on each actor's own node."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.config.schema import ConfigError
from asyncrl.net import advertised_host, is_loopback

MULTINODE = (
    "cluster.bind_host=0.0.0.0",
    "rollout.transport_host=0.0.0.0",
    "cluster.placement_strategy=STRICT_SPREAD",
)


@pytest.fixture(scope="module")
def two_nodes():
    """A head node ({node_a: 1}) and a worker node ({node_b: 1}), 2 CPUs each."""
    import ray

    from tests.ray_nodes import two_node_cluster

    ray.shutdown()  # a local Ray left by another test module
    cluster = two_node_cluster(cpus=2)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def shrunk(model_dir, out, address, *extra):
    return load_config(
        None,
        [
            f"actor_train.model_args.model_name_or_path={model_dir}",
            f"output_dir={out}",
            f"cluster.address={address}",
            *MULTINODE,
            "max_steps=3",
            "rollout_batch_size=2",
            "num_return_sequences_in_group=2",
            "response_length=4",
            "actor_infer.device_mapping=[0,1]",
            "rollout.num_actors=2",
            "rollout.max_inflight_prompts=2",
            "rollout.reward_fn=tests.e2e_rewards:digit_fraction",
            "logging.eval_interval=0",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.plots=false",
            "actor_train.model_args.disable_gradient_checkpointing=true",
            *extra,
        ],
    )


def unauthorized(url: str) -> bool:
    """True if the engine refuses a control call that carries no API key."""
    req = urllib.request.Request(url + "/flush_cache", data=b"{}", method="POST")
    try:
        urllib.request.urlopen(req, timeout=10)
    except urllib.error.HTTPError as e:
        return e.code == 401
    return False


STEPS = 12


def test_run_trains_through_engines_and_workers_on_two_nodes(tiny_model, tmp_path, two_nodes):
    import ray

    from asyncrl.engine.placement import PlacedLauncher
    from asyncrl.rollout.ray_pool import RayWorkerPool
    from asyncrl.run import run
    from asyncrl.weights.sync import WeightSender

    seen: dict[str, list] = {"engines": [], "urls": [], "refused": [], "workers": []}
    launch, pool_init = PlacedLauncher.launch, RayWorkerPool.__init__
    send_bucket = WeightSender._send_bucket
    first_trained = tmp_path / "trained_groups.jsonl"
    victim: list[int] = []  # engine 0's server pid, until it is killed

    def recording_launch(self, index, port=None):
        handle = launch(self, index, port)
        seen["engines"].append(ray.get(self.actors[index].node.remote()))
        seen["urls"].append(handle.url)
        seen["refused"].append(unauthorized(handle.url))
        if len(seen["urls"]) == 1:
            victim.append(handle.proc.pid)
        return handle

    def killing_send_bucket(self, *args, **kwargs):
        """Engine 0's server (rank 1 of the update group) is killed -9 as the first sync
        after a trained step sends its first bucket: the learner's broadcast fails on it, and
        engine 1 is left inside a receive that only the group's timeout would end; the heal
        must abandon that receive and bring both engines back."""
        if victim and first_trained.exists() and first_trained.read_text().strip():
            os.kill(victim.pop(), signal.SIGKILL)
        return send_bucket(self, *args, **kwargs)

    def recording_pool(self, settings_for, num_workers, options_for=None, address=None):
        pool_init(self, settings_for, num_workers, options_for, address)
        seen["workers"] = self.node_ids()
        seen["transport_host"] = settings_for(0).transport_host

    mp = pytest.MonkeyPatch()
    mp.setattr(PlacedLauncher, "launch", recording_launch)
    mp.setattr(RayWorkerPool, "__init__", recording_pool)
    mp.setattr(WeightSender, "_send_bucket", killing_send_bucket)
    try:
        # 12 steps: the kill comes with the sync after the first trained step, and the heal
        # it must show needs steps after it; each step needs fresh groups
        summary = run(shrunk(tiny_model, tmp_path, two_nodes.address, f"max_steps={STEPS}"))
    finally:
        mp.undo()
    cluster_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    engine_nodes = {node for node, _ in seen["engines"]}
    assert engine_nodes == cluster_nodes and len(cluster_nodes) == 2  # one engine per node
    assert not victim  # killed during a sync
    assert len(seen["urls"]) == 3 and seen["urls"][2] == seen["urls"][0]  # healed in place
    assert set(seen["workers"]) == cluster_nodes  # workers beside their engines
    # every advertised address is the node's own (Ray's), never loopback
    for (_, ip), url in zip(seen["engines"], seen["urls"], strict=True):
        assert url.startswith(f"http://{ip}:") and not is_loopback(ip)
    assert seen["transport_host"] == ray.util.get_node_ip_address()
    assert not is_loopback(seen["transport_host"])
    assert all(seen["refused"])  # a routable engine wants the run's key
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("version") is not None]
    assert rows[-1]["version"] == STEPS and summary["groups_trained"] == 2 * STEPS
    assert rows[-1]["engines/engine_restarts"] == 1
    assert rows[-1]["transport/received"] >= 4
    assert all(r["sync/seconds"] > 0 for r in rows)  # the update group met on the node IP


def test_advertised_host_is_rays_node_ip(monkeypatch):
    """A wildcard bind is advertised at the address Ray gives this node; others as bound."""
    import ray

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.1.2.3")
    assert advertised_host("0.0.0.0") == "10.1.2.3"
    assert advertised_host("::") == "10.1.2.3"
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("192.0.2.7") == "192.0.2.7"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster.address=auto"], "cluster.bind_host '127.0.0.1' cannot be bound"),
        (
            ["cluster.address=auto", "cluster.bind_host=0.0.0.0"],
            "rollout.transport_host '127.0.0.1' is loopback",
        ),
        (["cluster.engine_bundle={GPU: 1}"], "cluster.engine_bundle.GPU is set by asyncrl"),
        (["cluster.engine_bundle={node_b: 0}"], "cluster.engine_bundle.node_b must be"),
        (["cluster.learner_bundle={CPU: 1}"], "cluster.learner_bundle.CPU is set by asyncrl"),
        (["cluster.engine_bundle={node_b: 1}"], "engine_bundle places parts of the run"),
        (["cluster.learner_bundle={node_b: 1}"], "learner_bundle places parts of the run"),
        (["cluster.placement_strategy=PACK"], "placement_strategy places parts of the run"),
        (["cluster.bind_host=''"], "cluster.bind_host must name an address"),
    ],
)
def test_multinode_config_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)


def test_multinode_recipe_validates():
    from pathlib import Path

    cfg = load_config(Path(__file__).parents[1] / "configs" / "multinode-cpu-2nodes.yaml", [])
    assert cfg.cluster.address and cfg.cluster.bind_host == "0.0.0.0"


def test_gloo_ranks_listen_on_the_route_to_a_routable_master(monkeypatch):
    """Off loopback, a rank's gloo pairs listen on the interface that reaches the master, not on
    whatever the host name resolves to (127.0.0.1 here: peers on other nodes could not
    connect); a two-rank group over this machine's routable address then broadcasts."""
    import torch
    import torch.distributed as dist

    from asyncrl.net import free_port, route_ip
    from asyncrl.weights import group as wg

    try:  # any off-host address: the kernel's route to it, nothing is sent
        ip = route_ip("192.0.2.1")
    except OSError:
        ip = "127.0.0.1"
    if is_loopback(ip):
        pytest.skip("this machine has no routable interface")
    made: list[str] = []
    create = dist.ProcessGroupGloo.create_device

    def recording(**kw):
        made.append(kw.get("hostname", ""))
        return create(**kw)

    monkeypatch.setattr(dist.ProcessGroupGloo, "create_device", staticmethod(recording))
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    port, out = free_port(), torch.zeros(3)

    def join(rank: int, tensor: torch.Tensor) -> None:
        pg = wg.create_group("gloo", ip, port, rank, 2, "mn-test", timeout_s=30)
        wg.broadcast([tensor], pg)
        wg.destroy_group(pg)

    peer = threading.Thread(target=join, args=(1, out), daemon=True)
    peer.start()
    join(0, torch.arange(3.0))
    peer.join(timeout=60)
    assert made == [ip, ip] and torch.equal(out, torch.arange(3.0))


def test_sglang_takes_the_cluster_bind_host_and_keeps_router_metrics_on_loopback():
    """cluster.bind_host reaches SGLang's servers and router (unless strategy_config.host says
    otherwise); the router's Prometheus exporter stays on loopback even then."""
    from asyncrl.config.schema import StrategyArgs, WorkerConfig
    from asyncrl.device import SPECS
    from asyncrl.engine import sglang as sl

    infer = WorkerConfig(strategy_args=StrategyArgs("sglang"), device_mapping=[0, 1])
    args = (infer, Path("m"), Path("logs"), 0, SPECS["cpu"], "key")
    launcher = sl.SGLangLauncher(*args, host="0.0.0.0")
    assert launcher.settings.host == "0.0.0.0"
    argv = sl.router_command(["http://10.0.0.1:30000"], 5000, launcher.settings)
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
    infer.strategy_args.strategy_config["host"] = "10.0.0.9"
    assert sl.SGLangLauncher(*args, host="0.0.0.0").settings.host == "10.0.0.9"


def test_unplaced_workers_stay_on_the_driver_node(tiny_model, tmp_path, two_nodes):
    """A single-host run that joined a cluster anyway (RAY_ADDRESS) keeps its rollout workers on
    the driver's node, where its loopback engines and receiver are."""
    import ray

    from asyncrl.net import init_ray
    from asyncrl.rollout.ray_pool import RayWorkerPool
    from asyncrl.startup import rollout_settings
    from asyncrl.transport.zmq import Receiver, ReceiverConfig

    init_ray(two_nodes.address)
    cfg = load_config(None, [f"actor_train.model_args.model_name_or_path={tiny_model}"])
    with Receiver(ReceiverConfig()) as receiver:
        made = rollout_settings(cfg, tiny_model, ["http://127.0.0.1:9"], receiver.port)
        pool = RayWorkerPool(lambda index: made, 4)
        try:
            nodes = pool.node_ids()
        finally:
            pool.close()
    assert set(nodes) == {ray.get_runtime_context().get_node_id()}


def test_learner_ranks_on_another_node_meet_rank_0_at_its_address(tiny_model, tmp_path, two_nodes):
    """fsdp2_train on two devices of a two-node cluster: rank 1 is placed by
    `cluster.learner_bundle` on the worker node and rendezvouses with rank 0 (the driver) at
    the driver node's address; the run trains through both ranks."""
    import ray

    from asyncrl.learner.placement import RankPlacement
    from asyncrl.run import run

    seen: dict[str, list] = {"hosts": [], "groups": []}
    options, host = RankPlacement.actor_options, RankPlacement.rendezvous_host

    def recording_options(self, ranks):
        made = options(self, ranks)
        seen["groups"] += [o["scheduling_strategy"].placement_group for o in made]
        return made

    def recording_host(self):
        seen["hosts"].append(host(self))
        return seen["hosts"][-1]

    mp = pytest.MonkeyPatch()
    mp.setattr(RankPlacement, "actor_options", recording_options)
    mp.setattr(RankPlacement, "rendezvous_host", recording_host)
    extra = ("actor_train.device_mapping=[0,1]", "cluster.learner_bundle={node_b: 1}")
    try:
        summary = run(shrunk(tiny_model, tmp_path, two_nodes.address, *extra))
        worker_node = next(n["NodeID"] for n in ray.nodes() if "node_b" in n["Resources"])
        placed = {
            node
            for group in seen["groups"]
            for node in ray.util.placement_group_table(group)["bundles_to_node_id"].values()
        }
    finally:
        mp.undo()
    assert placed == {worker_node}
    assert seen["hosts"] and not any(is_loopback(h) for h in seen["hosts"])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("version") is not None]
    assert rows[-1]["version"] == 3 and summary["groups_trained"] == 6
    assert all(r["learner/world_size"] == 2.0 for r in rows)

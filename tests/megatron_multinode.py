"""The real Megatron learner (`MegatronLearner`) placed across the two nodes of a Ray cluster on
this machine, against the torch learner (one process, fp32) on the same batch.

    python tests/megatron_multinode.py MODEL_DIR OUT_JSON TP PP WORLD [kill]

Each node declares 2 GPUs (`ray.cluster_utils.Cluster`); with `ASYNCRL_RANK_ACCELERATOR=GPU`
the learner places its ranks exactly as on a GPU cluster (the node plan, rank 0's GPU held for
the driver, each remote rank holding one Ray GPU and told its LOCAL_RANK), while every rank
computes on the CPU through Megatron's CUDA-call redirect (`tests/megatron_emulation.py`),
applied in each Ray worker by the job's `worker_process_setup_hook` and in this driver.
Writes each remote rank's report (node, GPU ids, environment), the plan and the differences.
With `kill`, the last rank's process is then killed -9 and the next step's failure recorded
(`lost`: its one line, `lost_within_s`: whether it came within the collective timeout).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _cluster():
    import ray

    from tests.ray_nodes import two_node_cluster

    cluster = two_node_cluster(cpus=3, gpus=2)
    hook = {"worker_process_setup_hook": "tests.megatron_emulation.apply"}
    ray.init(address=cluster.address, runtime_env=hook, log_to_driver=True)
    head = next(n["NodeID"] for n in ray.nodes() if "node_a" in n["Resources"])
    return cluster, head


def _reference(model_dir: Path, batch: list) -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
    """The torch learner's step on `batch`: metrics, weights after, logprobs before, mask."""
    sys.path.insert(0, str(HERE / "gpu"))
    import test_megatron_gpu as g

    from asyncrl.learner.collate import collate
    from asyncrl.learner.logprobs import token_logprobs
    from asyncrl.learner.torch.learner import TorchLearner

    tcfg, _ = g.configs()
    ref = TorchLearner(model_dir, tcfg.actor_train, tcfg.actor, tcfg.algorithm, temperature=0.7,
                       total_steps=10)  # fmt: skip
    data = collate(sorted(batch, key=lambda x: x.group_id), ref.pad_id).to_torch("cpu")
    with torch.no_grad():
        want = token_logprobs(ref.model, data, 0.7)[0]
    metrics = ref.step(batch)
    return metrics, dict(ref.weights_for_sync()), want, data["response_mask"].bool()


def _killed_step(learner, batch: list) -> str:
    """Kill the last rank's process, then step: the failure's line (waited with a deadline)."""
    import signal
    import threading

    os.kill(learner.ranks[-1]["pid"], signal.SIGKILL)
    done, failure = threading.Event(), []

    def step() -> None:
        try:
            learner.step(batch)
        except Exception as e:  # what the run would see
            failure.append(f"{type(e).__name__}: {e}")
        done.set()

    threading.Thread(target=step, daemon=True).start()
    if not done.wait(timeout=240):
        return "the step did not end"
    return failure[0] if failure else "the step succeeded"


def main() -> None:
    sys.path.insert(0, str(HERE / "gpu"))
    sys.path.insert(0, str(HERE))
    import megatron_emulation as emu
    import test_megatron_gpu as g

    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    tp, pp, world = (int(x) for x in sys.argv[3:6])
    model_dir = emu.tiny_variant(src, out.parent / "work" / "model", None, tied=pp == 1)
    batch = g.groups()
    want_metrics, after, want_lp, mask = _reference(model_dir, batch)
    cluster, head = _cluster()
    emu.apply()  # this driver is rank 0
    os.environ["ASYNCRL_RANK_ACCELERATOR"] = "GPU"
    from asyncrl.device import SPECS
    from asyncrl.learner.megatron.learner import MegatronLearner
    from asyncrl.learner.placement import RankPlacement

    _, cfg = g.configs(tp, str(list(range(world))))
    cfg.actor_train.strategy_args.strategy_config.update(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    kill = sys.argv[6:] == ["kill"]  # then a short collective timeout: the loss is bounded
    placement = RankPlacement(multinode=True, collective_timeout_s=30.0 if kill else 300.0)
    learner = MegatronLearner(model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, 0.7, 10,
                              device=SPECS["cpu"], placement=placement)  # fmt: skip
    try:
        lp = learner.logprobs(batch)
        metrics = learner.step(batch)
        weights = {n: t.float() for n, t in learner.weights_for_sync()}
        result = {
            "head": head,
            "slots": [[s.rank, s.node, s.local_rank] for s in learner._placed.slots],
            "nodes": [node for node, _ in learner._placed.nodes],
            "rank0_gpu": learner._placed.rank0_device,
            "ranks": learner.ranks,
            # rank 0's: a first pipeline stage returns none (the last stage scores)
            "logprob_max_diff": None if lp is None else (lp[mask] - want_lp[mask]).abs().max().item(),
            "metrics": {k: [want_metrics[k], metrics[k]] for k in ("actor/pg_loss",
                                                                   "actor/grad_norm")},
            "weight_max_diff": max((t - after[n].float()).abs().max().item()
                                   for n, t in weights.items()),
            "world_size": metrics["learner/world_size"],
        }  # fmt: skip
        if kill:
            result["lost"] = _killed_step(learner, batch)
    finally:
        learner.close()
    out.write_text(json.dumps(result))
    import ray

    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()

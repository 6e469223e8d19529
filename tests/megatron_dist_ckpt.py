"""Save the Megatron learner's sharded checkpoint at one parallel layout, resume it at another.

    python tests/megatron_dist_ckpt.py MODEL_DIR OUT_JSON SAVE_LAYOUT LOAD_LAYOUT
    python tests/megatron_dist_ckpt.py MODEL_DIR OUT_JSON ray|one

A layout is JSON: {"world": W, "tp": .., "pp": .., "extra": {strategy_config keys}} or, with
"learner": true, one rank as `MegatronLearner` in its own process whose checkpoints go
through the real checkpoint manager (`Checkpointer.save`, and `find` + `Loaded.apply` on
resume); the other ranks are `MegatronWorker`s (tests/megatron_emulation.py's CPU emulation),
which read a manager-written checkpoint through `Checkpointer.find` too.

The saving run takes a step, saves, and takes a second step (the un-interrupted run). The
resuming run loads the weights alone and takes that second step (no moments: it must differ),
then loads weights and optimizer state and takes it again: its weights and metrics must equal
the un-interrupted run's. OUT_JSON gets the differences.

`ray`: `MegatronLearner` itself at TP2 x PP2 over four ranks on two Ray nodes
(tests/megatron_multinode.py's cluster; the driver is rank 0, the others Ray actors), output_dir
checked shared at start, its checkpoint saved through `Checkpointer` with `async_save` (every
rank writing its shards), then resumed in place through `find` + `Loaded.apply`; `one`: the
same with one rank in this process (no Ray).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "gpu"))

KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy")


def _configs(layout: dict):
    import test_megatron_gpu as g

    world = layout["world"]
    _, cfg = g.configs(layout.get("tp", 1), str(list(range(world))))
    cfg.actor_train.strategy_args.strategy_config.update(
        tensor_model_parallel_size=layout.get("tp", 1),
        pipeline_model_parallel_size=layout.get("pp", 1), **layout.get("extra", {}),
    )  # fmt: skip
    return cfg


def _exported(weights) -> dict[str, torch.Tensor]:
    return {n: t.detach().float().clone().cpu() for n, t in weights}


def _metrics(metrics: dict) -> dict[str, float]:
    return {k: float(metrics[k]) for k in KEYS if k in metrics}


def _resume_state(root: Path) -> tuple[str, dict]:
    """The shard directory and the learner state of the newest checkpoint under `root`."""
    from asyncrl.checkpoint import Checkpointer

    loaded, skipped = Checkpointer(root, ["model", "optimizer"]).find("auto")
    assert loaded is not None, skipped
    return loaded.state["sharded_dir"], loaded.state


def worker_rank(rank: int, world: int, init: str, model_dir: str, layout: dict, work: str,
                mode: str) -> None:  # fmt: skip
    import megatron_emulation as emu

    emu.apply()
    import test_megatron_gpu as g

    from asyncrl.device import SPECS
    from asyncrl.learner.megatron.worker import MegatronWorker

    cfg = _configs(layout)
    worker = MegatronWorker(model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, 0.7, 10,
                            rank=rank, world_size=world, init_method=init, device=SPECS["cpu"])  # fmt: skip
    batch, out = g.groups(), {}
    shards = Path(work) / "shards"
    if mode == "save":
        worker.step(batch)
        shards.mkdir(exist_ok=True)  # every rank: one host here (a shared directory)
        torch.distributed.barrier()
        worker.save_sharded(str(shards), True)
        # what MegatronLearner.state_dict holds beside the shards
        resume = {"lr_step": worker.lr_step, "version": worker.version}
        out["resume"] = {**resume, "layout": worker.optimizer_layout()}
        out["uninterrupted"] = _step_after(worker, batch, None, None, optimizer=True)
    else:
        saved = json.loads((Path(work) / "resume.json").read_text())
        path = str(shards)
        if saved.get("checkpointer"):  # written by the manager: read back through it
            path, state = _resume_state(Path(work) / "run")
            saved = {k: state[k] for k in ("lr_step", "version")}
        out["weights_only"] = _step_after(worker, batch, path, saved, optimizer=False)
        out["resumed"] = _step_after(worker, batch, path, saved, optimizer=True)
    torch.save(out, Path(work) / f"rank{rank}.pt")


def _step_after(worker, batch, path, saved, optimizer: bool) -> dict:
    """(load, then) one step: the exported weights (rank 0) and the last stage's metrics."""
    if path is not None:
        worker.load_sharded(path, optimizer)
        worker.lr_step, worker.version = saved["lr_step"], saved["version"]
    metrics = worker.step(batch)
    return {"weights": _exported(worker.export()), "metrics": _metrics(metrics)}


def learner_rank(rank: int, model_dir: str, layout: dict, work: str, mode: str) -> None:
    """One rank as `MegatronLearner`, its checkpoints through `Checkpointer`."""
    import megatron_emulation as emu

    emu.apply()
    import test_megatron_gpu as g

    from asyncrl.checkpoint import Checkpointer
    from asyncrl.device import SPECS
    from asyncrl.learner.megatron.learner import MegatronLearner

    cfg = _configs(layout)
    learner = MegatronLearner(model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, 0.7, 10,
                              device=SPECS["cpu"])  # fmt: skip
    batch, out, run = g.groups(), {}, Path(work) / "run"
    manager = Checkpointer(run, ["model", "optimizer"])
    if mode == "save":
        learner.step(batch)
        manager.save(1, learner, {})
        out["resume"] = {"checkpointer": True}
        metrics = learner.step(batch)
        out["uninterrupted"] = {"weights": _exported(learner.weights_for_sync()),
                                "metrics": _metrics(metrics)}  # fmt: skip
    else:
        saved = json.loads((Path(work) / "resume.json").read_text())
        for key, contents in (("weights_only", {"model"}), ("resumed", {"model", "optimizer"})):
            if saved.get("checkpointer"):
                loaded, skipped = manager.find("auto")
                assert loaded is not None, skipped
                loaded.apply(learner, contents)
            else:  # a worker-level save: the state a checkpoint's learner.pt would hold
                state = {"model": "sharded", "sharded_dir": str(Path(work) / "shards"),
                         **saved, "optimizer": "sharded"}  # fmt: skip
                if "optimizer" not in contents:
                    state.pop("optimizer")
                learner.load_state_dict(state)
            metrics = learner.step(batch)
            out[key] = {"weights": _exported(learner.weights_for_sync()),
                        "metrics": _metrics(metrics)}  # fmt: skip
    learner.close()
    torch.save(out, Path(work) / f"rank{rank}.pt")


def run(model_dir: Path, layout: dict, work: Path, mode: str) -> list[dict]:
    import torch.multiprocessing as mp

    world = layout["world"]
    for r in range(world):
        (work / f"rank{r}.pt").unlink(missing_ok=True)
    if layout.get("learner"):
        mp.spawn(learner_rank, args=(str(model_dir), layout, str(work), mode), nprocs=1)
    else:
        (work / "rendezvous").unlink(missing_ok=True)
        init = f"file://{work / 'rendezvous'}"
        mp.spawn(worker_rank, args=(world, init, str(model_dir), layout, str(work), mode),
                 nprocs=world)  # fmt: skip
    return [torch.load(work / f"rank{r}.pt") for r in range(world)]


def _last(ranks: list[dict], key: str) -> dict:
    """Rank 0's weights and the metrics of the rank that reported them (a last stage)."""
    metrics = next((r[key]["metrics"] for r in ranks if r[key]["metrics"]), {})
    return {"weights": ranks[0][key]["weights"], "metrics": metrics}


def _diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _learner_step(learner, batch) -> dict:
    metrics = learner.step(batch)
    return {"weights": _exported(learner.weights_for_sync()), "metrics": _metrics(metrics)}


def in_place(src: Path, out_json: Path, multinode: bool) -> None:
    """The `ray` and `one` modes (see the module docstring)."""
    import os

    import megatron_emulation as emu
    import megatron_multinode as mn

    work = out_json.parent / "work"
    model_dir = emu.tiny_variant(src, work / "model", None, tied=False)
    cluster = mn._cluster()[0] if multinode else None
    emu.apply()  # this driver is rank 0
    if multinode:  # ranks hold the GPUs the Ray nodes declare, computing on the CPU
        os.environ["ASYNCRL_RANK_ACCELERATOR"] = "GPU"
    from asyncrl.learner.placement import RankPlacement

    run = work / "run"
    run.mkdir(parents=True, exist_ok=True)
    placement = RankPlacement(multinode=multinode, collective_timeout_s=300.0, shared_dir=str(run))
    layout = {"world": 4, "tp": 2, "pp": 2} if multinode else {"world": 1}
    try:
        out_json.write_text(json.dumps(_save_and_resume(model_dir, layout, placement, run)))
    finally:
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.shutdown()


def _save_and_resume(model_dir: Path, layout: dict, placement, run: Path) -> dict:
    """`MegatronLearner`: a step, an async save through `Checkpointer`, a second step; then
    resumed in place through `find` + `apply` (weights alone, then with the optimizer state)
    and the second step again; a state saved with the other optimizer kind is refused."""
    import test_megatron_gpu as g

    from asyncrl.checkpoint import Checkpointer
    from asyncrl.device import SPECS
    from asyncrl.learner.megatron.learner import MegatronLearner
    from asyncrl.learner.megatron.optim_state import OptimizerLayoutError
    from asyncrl.learner.placed_ranks import SHARED_CHECK

    cfg, batch = _configs(layout), g.groups()
    learner = MegatronLearner(model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, 0.7, 10,
                              device=SPECS["cpu"], placement=placement)  # fmt: skip
    try:
        learner.step(batch)
        manager = Checkpointer(run, ["model", "optimizer"], async_save=True)
        manager.save(1, learner, {})
        want = _learner_step(learner, batch)  # while the rest is written in the background
        manager.wait()
        got = {}
        for key, contents in (("weights_only", {"model"}), ("resumed", {"model", "optimizer"})):
            loaded, skipped = manager.find("auto")
            assert loaded is not None, skipped
            loaded.apply(learner, contents)
            got[key] = _learner_step(learner, batch)
        state = manager.find("auto")[0].state
        state["layout"] = {**state["layout"], "distributed_optimizer": True}
        try:
            learner.load_state_dict(state)
            refused = ""
        except OptimizerLayoutError as e:
            refused = str(e)
        shards = sorted(p.name for p in (run / "checkpoints" / "step_1" / "learner").iterdir())
        # the driver wrote a nonce into output_dir at start and each rank read it back
        shared = [(run / SHARED_CHECK).is_file()] + [r["shared"] for r in learner.ranks] if (
            learner.remotes) else []  # fmt: skip
    finally:
        learner.close()
    return {
        "resumed_weight_max_diff": _diff(got["resumed"]["weights"], want["weights"]),
        "weights_only_weight_max_diff": _diff(got["weights_only"]["weights"], want["weights"]),
        "metrics": {k: [want["metrics"][k], got["resumed"]["metrics"].get(k)]
                    for k in want["metrics"]},
        "shard_files": shards, "shared_checked": shared, "refused": refused,
    }  # fmt: skip


def main() -> None:
    import megatron_emulation as emu

    src, out_json = Path(sys.argv[1]), Path(sys.argv[2])
    if sys.argv[3] in ("ray", "one"):
        in_place(src, out_json, multinode=sys.argv[3] == "ray")
        return
    save_layout, load_layout = json.loads(sys.argv[3]), json.loads(sys.argv[4])
    work = out_json.parent / "work"
    work.mkdir(parents=True, exist_ok=True)
    # untied: the same model loads at PP 1 and PP 2
    model_dir = emu.tiny_variant(src, work / "model", None, tied=False)
    saved = run(model_dir, save_layout, work, "save")
    (work / "resume.json").write_text(json.dumps(saved[0]["resume"]))
    resumed = run(model_dir, load_layout, work, "load")
    want = _last(saved, "uninterrupted")
    got, alone = _last(resumed, "resumed"), _last(resumed, "weights_only")
    out_json.write_text(json.dumps({
        "resumed_weight_max_diff": _diff(got["weights"], want["weights"]),
        "weights_only_weight_max_diff": _diff(alone["weights"], want["weights"]),
        "metrics": {k: [want["metrics"][k], got["metrics"].get(k)] for k in want["metrics"]},
    }))  # fmt: skip


if __name__ == "__main__":
    main()

"""Run the real Megatron learner on the CPU by redirecting Megatron's CUDA-only calls.

megatron-core hard-codes CUDA in a few places (device="cuda" buffers, the CUDA RNG tracker,
`torch.cuda.current_device()`, CUDA streams in 0.17+); here those calls land on the CPU and the process group is gloo,
so `MegatronWorker` (asyncrl's code, unchanged) builds, scores, steps and exports a tiny model
on a CPU box. The redirect is the edge that is faked; Megatron's TP/PP/DP logic and asyncrl's
all run for real. Activation recompute is out of reach (it saves CUDA RNG states).

    python tests/megatron_emulation.py MODEL_DIR OUT_JSON TP PP [VOCAB] [EXTRA_JSON] [DTYPE]
    python tests/megatron_emulation.py MODEL_DIR OUT_JSON learner

compares the ranks (two unless EXTRA_JSON says) of `MegatronWorker` with `TorchLearner` (one
process, fp32) on the same batch and writes the differences to OUT_JSON. EXTRA_JSON updates the
Megatron `strategy_config`, except its keys "algorithm" and "actor" (`algorithm.*`, `actor.*`
settings for both learners) and "world" (the number of ranks, 2 unless given).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


class CpuStream:
    """The current CUDA stream as Megatron uses it (megatron-core 0.17+ asks for it in every
    DDP gradient sync), on the CPU: every op runs in issue order on the one thread, so a wait
    on another stream or event is already satisfied."""

    def wait_stream(self, other: CpuStream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


def apply() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    stream = CpuStream()
    torch.cuda.current_stream = torch.cuda.default_stream = lambda *a, **k: stream

    def cpuify(fn):
        def wrapped(*a, **k):
            if "cuda" in str(k.get("device", "")):
                k["device"] = "cpu"
            k.pop("pin_memory", None)  # pinned host memory needs an accelerator
            return fn(*a, **k)

        return wrapped

    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like"):
        setattr(torch, name, cpuify(getattr(torch, name)))
    to, type_of = torch.Tensor.to, torch.Tensor.type

    def to_cpu(self, *a, **k):
        a = tuple("cpu" if isinstance(x, str) and "cuda" in x else x for x in a)
        if "cuda" in str(k.get("device", "")):
            k["device"] = "cpu"
        return to(self, *a, **k)

    torch.Tensor.to = to_cpu
    torch.Tensor.cuda = lambda self, *a, **k: self
    # Megatron's gradient clipping asserts CUDA tensor types
    torch.Tensor.type = lambda self, *a, **k: (
        type_of(self).replace("torch.", "torch.cuda.")
        if not a and not k
        else type_of(self, *a, **k)
    )
    import megatron.core.tensor_parallel as tp_mod
    import megatron.core.tensor_parallel.random as rnd

    rnd.model_parallel_cuda_manual_seed = tp_mod.model_parallel_cuda_manual_seed = lambda *a, **k: (
        None
    )
    for name in dir(rnd):
        cls = getattr(rnd, name)
        if isinstance(cls, type) and hasattr(cls, "fork"):
            cls.fork = lambda self, *a, **k: contextlib.nullcontext()


def rank_main(rank: int, world: int, init: str, model_dir: str, setup: dict, out: str) -> None:
    apply()
    sys.path.insert(0, str(HERE / "gpu"))
    sys.path.insert(0, str(HERE))
    import megatron_head_check as hc
    import test_megatron_gpu as g

    from asyncrl.device import SPECS
    from asyncrl.learner.megatron.worker import MegatronWorker

    _, cfg = g.configs(setup["tp"], str(list(range(world))))
    for section in ("algorithm", "actor"):
        for key, value in setup[section].items():
            setattr(getattr(cfg, section), key, value)
    cfg.actor_train.strategy_args.strategy_config.update(
        tensor_model_parallel_size=setup["tp"], pipeline_model_parallel_size=setup["pp"],
        **setup["extra"],
    )  # fmt: skip
    cfg.actor_train.model_args.dtype = setup["dtype"]
    for key, value in setup["train"].items():
        setattr(cfg.actor_train.training_args, key, value)
    worker = MegatronWorker(model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, 0.7, 10,
                            rank=rank, world_size=world, init_method=init, device=SPECS["cpu"])  # fmt: skip
    hc.small_chunks(worker)  # the whole run's scores span several chunks
    batch = g.groups()
    lp = worker.logprobs(batch)
    head = hc.compare(worker, batch)  # the chunked head against the full logits
    head_fallbacks = hc.fallbacks(worker)
    metrics = worker.step(batch)
    steps = worker.lr_step  # its optimizer steps on this rollout, against the plan's
    weights = {n: t.float().clone() for n, t in worker.export()}
    resumed = resume_gap(worker, batch, weights)
    # A checkpoint's way back in (every rank gets the full HF tensors and loads its shards,
    # chunk by chunk): the initial weights must score exactly as before the step.
    from asyncrl.learner.megatron.weights import HFCheckpoint

    initial = HFCheckpoint(model_dir)
    worker.load_hf({name: initial(name) for name in initial.where})
    reloaded = worker.logprobs(batch)
    torch.save({"lp": lp, "metrics": metrics, "weights": weights, "reloaded": reloaded,
                "resumed": resumed, "steps": [planned_steps(cfg, batch), steps], "head": head,
                "head_fallbacks": head_fallbacks},
               f"{out}/rank{rank}.pt")  # fmt: skip


def run_ranks(world: int, model_dir: Path, setup: dict, work: Path) -> list[dict]:
    """Every rank's `rank_main` in its own process; what each saved."""
    import torch.multiprocessing as mp

    # a file store in the run's own directory: a port picked free here could be taken by
    # another process before rank 0 listens on it
    (work / "rendezvous").unlink(missing_ok=True)
    init = f"file://{work / 'rendezvous'}"
    mp.spawn(rank_main, args=(world, init, str(model_dir), setup, str(work)), nprocs=world)
    return [torch.load(work / f"rank{r}.pt") for r in range(world)]


def torch_mini_batch(actor: dict, train: dict, dp: int) -> dict:
    """The torch learner's actor settings (one rank): ROLL's global batch of the Megatron
    ranks as its mini-batch, where `train` sets gradient_accumulation_steps."""
    if "gradient_accumulation_steps" not in train:
        return actor
    micro = train.get("per_device_train_batch_size", 3)  # tests/gpu's configs
    return {**actor, "ppo_mini_batch_size": micro * train["gradient_accumulation_steps"] * dp}


def planned_steps(cfg, batch) -> int:
    """The plan's optimizer steps per rollout for this batch (`config show`'s number)."""
    import dataclasses

    from asyncrl.config import derive_plan

    sizes = {len(g.response_lengths) for g in batch}
    assert len(sizes) == 1, "one group size"
    rollout = dataclasses.replace(cfg, rollout_batch_size=len(batch),
                                  num_return_sequences_in_group=sizes.pop())  # fmt: skip
    return derive_plan(rollout).optimizer_steps_per_rollout


def resume_gap(worker, batch, weights: dict) -> float | None:
    """A second step, then the checkpoint's way back (weights + this rank's optimizer state
    through a torch.save round trip, the schedule position) and the second step again: the
    largest difference between the two second steps' weights (None off rank 0). Without the
    optimizer state the moments and step count would be the second step's, not the first's."""
    import io

    full = [weights]  # every rank loads the full HF tensors; only rank 0 exported them
    torch.distributed.broadcast_object_list(full, src=0)
    weights = full[0]
    saved = io.BytesIO()
    torch.save(worker.optimizer_state(), saved)
    lr_step = worker.lr_step
    worker.step(batch)
    second = {n: t.float().clone() for n, t in worker.export()}
    worker.load_hf(weights)
    saved.seek(0)
    worker.load_optimizer_state(torch.load(saved, weights_only=True))
    worker.lr_step = lr_step
    worker.step(batch)
    again = {n: t.float().clone() for n, t in worker.export()}
    worker.load_hf(weights)  # back to the first step's weights for what follows
    if not second:
        return None
    return max((again[n] - t).abs().max().item() for n, t in second.items())


def older_state(learner) -> dict:
    """What learner.pt held before the Megatron learner's checkpoints were sharded: the full HF
    weights and each rank's optimizer state with its layout (one rank here)."""
    return {"version": learner.version, "lr_step": learner.local.lr_step,
            "model": {n: t.detach().clone() for n, t in learner.weights_for_sync()},
            "optimizer": {"layout": learner.local.optimizer_layout(),
                          "ranks": [learner.local.optimizer_state()]}}  # fmt: skip


def learner_resume(model_dir: Path, out_json: Path) -> None:
    """The older learner-level checkpoint on one rank (full weights and the rank's optimizer
    state in learner.pt, `older_state`, through the file and back): the step after a resume
    equals the step after the save; a state of another layout is refused before anything
    loads; an even older save (a bare optimizer state) still loads."""
    apply()
    sys.path.insert(0, str(HERE / "gpu"))
    import test_megatron_gpu as g

    from asyncrl.checkpoint import save_learner_file
    from asyncrl.device import SPECS
    from asyncrl.learner.megatron.learner import MegatronLearner
    from asyncrl.learner.megatron.optim_state import OptimizerLayoutError

    _, cfg = g.configs(1, "[0]")
    learner = MegatronLearner(model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, 0.7, 10,
                              device=SPECS["cpu"])  # fmt: skip
    batch = g.groups()
    learner.step(batch)
    save_learner_file(older_state(learner), out_json.parent / "learner.pt")
    state = torch.load(out_json.parent / "learner.pt", weights_only=True)
    learner.step(batch)
    second = dict(learner.weights_for_sync())
    learner.load_state_dict(state)
    learner.step(batch)
    gap = max((t - second[n]).abs().max().item() for n, t in learner.weights_for_sync())
    other = {**state, "optimizer": {**state["optimizer"], "layout": {
        **state["optimizer"]["layout"], "tensor_model_parallel_size": 2}}}  # fmt: skip
    try:
        learner.load_state_dict(other)
        refused = ""
    except OptimizerLayoutError as e:
        refused = str(e)
    learner.load_state_dict({**state, "optimizer": state["optimizer"]["ranks"][0][0]["common"]})
    learner.close()
    out_json.write_text(json.dumps({"resumed_step_max_diff": gap, "refused": refused}))


def tiny_variant(src: Path, dst: Path, vocab: int | None, tied: bool) -> Path:
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForCausalLM

    shutil.rmtree(dst, ignore_errors=True)
    cfg = AutoConfig.from_pretrained(src)
    cfg.tie_word_embeddings, cfg.num_hidden_layers = tied, 4
    cfg.layer_types = ["full_attention"] * 4
    cfg.vocab_size = vocab or cfg.vocab_size
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(cfg)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def main() -> None:
    sys.path.insert(0, str(HERE / "gpu"))
    import test_megatron_gpu as g
    from megatron_head_check import worst

    from asyncrl.learner.collate import collate
    from asyncrl.learner.logprobs import token_logprobs
    from asyncrl.learner.torch.learner import TorchLearner

    if sys.argv[3] == "learner":
        work = Path(sys.argv[2]).parent / "work"
        learner_resume(
            tiny_variant(Path(sys.argv[1]), work / "model", None, True), Path(sys.argv[2])
        )
        return
    src, out_json, tp, pp = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    vocab = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5] != "-" else None
    extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    algorithm, actor = extra.pop("algorithm", {}), extra.pop("actor", {})
    world = int(extra.pop("world", 2))
    train = extra.pop("train", {})  # Megatron's training_args
    dp = world // (tp * pp * extra.get("context_parallel_size", 1))
    actor = torch_mini_batch(actor, train, dp)
    dtype = sys.argv[7] if len(sys.argv) > 7 else "fp32"
    work = out_json.parent / "work"
    model_dir = tiny_variant(src, work / "model", vocab, tied=pp == 1)
    tcfg, _ = g.configs()
    for section, settings in (("algorithm", algorithm), ("actor", actor)):
        for key, value in settings.items():
            setattr(getattr(tcfg, section), key, value)
    ref = TorchLearner(model_dir, tcfg.actor_train, tcfg.actor, tcfg.algorithm, temperature=0.7,
                       total_steps=10)  # fmt: skip
    batch = g.groups()
    data = collate(sorted(batch, key=lambda x: x.group_id), ref.pad_id).to_torch("cpu")
    mask = data["response_mask"].bool()
    with torch.no_grad():
        want = token_logprobs(ref.model, data, 0.7)[0]
    ref_steps: list[int] = []
    ref.optimizer.register_step_post_hook(lambda *_: ref_steps.append(1))
    ref_metrics = ref.step(batch)
    after = dict(ref.weights_for_sync())
    setup = {"tp": tp, "pp": pp, "extra": extra, "dtype": dtype, "algorithm": algorithm,
             "actor": {k: v for k, v in actor.items() if not train or k != "ppo_mini_batch_size"},
             "train": train}  # fmt: skip
    ranks = run_ranks(world, model_dir, setup, work)
    last = next(r for r in ranks if r["lp"] is not None)
    keys = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "mismatch/mismatch_training_ppl",
            "learner/adv_mean", "learner/adv_max", "learner/adv_min")  # fmt: skip
    result = {
        "logprob_max_diff": (last["lp"][mask] - want[mask]).abs().max().item(),
        "reloaded_logprob_max_diff": (last["reloaded"][mask] - last["lp"][mask]).abs().max().item(),
        "metrics": {k: [ref_metrics[k], last["metrics"][k]] for k in keys},
        "exported": sorted(ranks[0]["weights"]),
        "weight_max_diff": max(
            (t - after[n].float()).abs().max().item() for n, t in ranks[0]["weights"].items()
        ),
        "silent_ranks_exported": [r for r in range(1, world) if ranks[r]["weights"]],
        "resumed_step_max_diff": ranks[0]["resumed"],
        # [planned, taken] per rank, and the torch learner's real optimizer steps
        "optimizer_steps": [r["steps"] for r in ranks],
        "torch_optimizer_steps": len(ref_steps),
        # per temperature, the largest difference over the ranks (logprob and entropy: the
        # last stage's) between the chunked head and the full-logits path
        "head": worst([r["head"] for r in ranks]),
        "head_fallbacks": ranks[-1]["head_fallbacks"],  # the last rank: a last stage
    }
    out_json.write_text(json.dumps(result))


if __name__ == "__main__":
    main()

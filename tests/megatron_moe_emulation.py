"""The Megatron learner on the embedded tiny Qwen3-MoE (8 experts, top-2, q/k norms), on the CPU
through `megatron_emulation.apply`, against the torch learner on the same model.

    python tests/megatron_moe_emulation.py OUT_JSON WORLD EXTRA_JSON

EXTRA_JSON updates the Megatron `strategy_config` (expert_model_parallel_size, ...), except
"router_replay": true, which replays recorded routes in both learners (actor.router_replay:
r3), and "optim" (actor.optim.name of both: adamw, the default, or sgd). Writes to OUT_JSON: the largest differences of logprobs, metrics and weights after one
step, whether the HF export of the loaded model equals the checkpoint bit for bit, and, with
replay, whether the experts Megatron's routers used are the replayed ones.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "gpu"))


def tiny_moe(dst: Path) -> Path:
    """The embedded MoE architecture, random weights spread wide enough that tokens route to
    different experts (no warm start: these tests compare learners, not accuracy)."""
    from asyncrl.models.tiny import build_model, build_tokenizer, embedded_spec

    tok = build_tokenizer()
    model = build_model(embedded_spec(arch="moe"), tok)
    torch.manual_seed(1)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
    return dst


def routes_for(batch: list, layers: int, k: int, experts: int, seed: int = 7) -> list:
    """The batch with made-up engine routes (what r3 replays): k distinct experts per layer at
    every position, `UNROUTED` at each response's last one (no engine forwarded it)."""
    import dataclasses

    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in batch:
        blocks = []
        for length in g.response_lengths:
            rows = len(g.prompt_ids) + int(length)
            ids = torch.stack([torch.randperm(experts, generator=gen)[:k]
                               for _ in range(rows * layers)]).reshape(rows, layers * k)  # fmt: skip
            ids[-1] = 255
            blocks.append(ids.to(torch.uint8))
        out.append(dataclasses.replace(g, routes=torch.cat(blocks).numpy()))
    return out


class CpuEvent:
    def synchronize(self) -> None:  # the CPU ran every op already, in issue order
        pass


def apply_moe() -> None:
    """`megatron_emulation.apply`, plus what Megatron's all-to-all token dispatcher asks of
    CUDA: a side stream for its device-to-host copies (on the CPU the current stream itself,
    so no cross-stream wait), an event on it, and `torch.cuda.stream(...)`; and its copy of
    the all-to-all split sizes to the host, which moves only CUDA tensors (on the CPU
    "device" tensors are host tensors already, and must still become the numpy sizes)."""
    import contextlib

    import megatron_emulation as me
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    me.apply()

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = to_host
    stream = torch.cuda.current_stream()
    type(stream).record_event = lambda self, *a, **k: CpuEvent()
    torch.cuda.Stream = lambda *a, **k: stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


def rank_main(rank: int, world: int, init: str, model_dir: str, setup: dict, out: str) -> None:
    apply_moe()
    import test_megatron_gpu as g

    from asyncrl.device import SPECS
    from asyncrl.learner.megatron.weights import HFCheckpoint
    from asyncrl.learner.megatron.worker import MegatronWorker

    _, cfg = g.configs(1, str(list(range(world))))
    cfg.actor_train.strategy_args.strategy_config.update(setup["extra"])
    cfg.actor.optim.name = setup["optim"]
    if setup["replay"]:
        cfg.actor.router_replay = "r3"
    worker = MegatronWorker(model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, 0.7, 10,
                            rank=rank, world_size=world, init_method=init, device=SPECS["cpu"])  # fmt: skip
    initial = HFCheckpoint(model_dir)
    exported = dict(worker.export())
    same = None
    if exported:
        same = sorted(exported) == sorted(initial.where) and all(
            torch.equal(t, initial(n)) for n, t in exported.items()
        )
    batch = setup["batch"]
    lp = worker.logprobs(batch)
    # (under context parallelism the check of the dispatched experts is not laid out: None)
    watch = setup["replay"] and setup["extra"].get("context_parallel_size", 1) == 1
    used = worker.replayed_routes(batch) if watch else None
    metrics = worker.step(batch)
    weights = {n: t.float().clone() for n, t in worker.export()}
    torch.save({"lp": lp, "metrics": metrics, "weights": weights, "roundtrip": same,
                "used": used}, f"{out}/rank{rank}.pt")  # fmt: skip


def main() -> None:
    import test_megatron_gpu as g

    from asyncrl.learner.collate import collate
    from asyncrl.learner.logprobs import token_logprobs
    from asyncrl.learner.routing import replay
    from asyncrl.learner.torch.learner import TorchLearner

    out_json, world, extra = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    replay_on = bool(extra.pop("router_replay", False))
    optim = extra.pop("optim", "adamw")
    work = out_json.parent / "work"
    model_dir = tiny_moe(work / "model")
    hf = json.loads((model_dir / "config.json").read_text())
    tcfg, _ = g.configs()
    tcfg.actor.optim.name = optim
    if replay_on:
        tcfg.actor.router_replay = "r3"
    ref = TorchLearner(model_dir, tcfg.actor_train, tcfg.actor, tcfg.algorithm, temperature=0.7,
                       total_steps=10)  # fmt: skip
    batch = g.groups()
    if replay_on:
        batch = routes_for(batch, hf["num_hidden_layers"], hf["num_experts_per_tok"],
                           hf["num_local_experts"])  # fmt: skip
    data = collate(sorted(batch, key=lambda x: x.group_id), ref.pad_id).to_torch("cpu")
    mask = data["response_mask"].bool()
    with torch.no_grad(), replay(ref.model, data.get("routes")):
        want = token_logprobs(ref.model, data, 0.7)[0]
    ref_metrics = ref.step(batch)
    after = dict(ref.weights_for_sync())
    setup = {"extra": extra, "replay": replay_on, "batch": batch, "optim": optim}
    ranks = run_ranks(world, model_dir, setup, work)
    last = next(r for r in ranks if r["lp"] is not None)
    keys = ("actor/pg_loss", "actor/entropy", "actor/grad_norm")
    got = ranks[0]["weights"]  # checkpoint names, as the torch learner's
    result = {
        "logprob_max_diff": (last["lp"][mask] - want[mask]).abs().max().item(),
        "metrics": {k: [ref_metrics[k], last["metrics"][k]] for k in keys},
        "names_match": sorted(got) == sorted(after),
        "weight_max_diff": max((t - after[n].float()).abs().max().item() for n, t in got.items()),
        "weight_change": max((after[n].float() - t).abs().max().item()
                             for n, t in dict(_initial(model_dir)).items()),
        "roundtrip_exact": ranks[0]["roundtrip"],
        "worst_weights": sorted(((t - after[n].float()).abs().max().item(), n)
                                for n, t in got.items())[-3:],
    }  # fmt: skip
    if replay_on and ranks[0]["used"] is not None:
        result["replay"] = replayed_check(ranks, data, hf["num_experts_per_tok"])
    if replay_on:  # the routers' own top-k against the replayed routes: replay changed them
        result.setdefault("replay", {})
        result["replay"]["torch_differ_frac"] = ref_metrics["learner/router_differ_frac"]
        result["replay"]["megatron_differ_frac"] = last["metrics"]["learner/router_differ_frac"]
    out_json.write_text(json.dumps(result))


def run_ranks(world: int, model_dir: Path, setup: dict, work: Path) -> list[dict]:
    """Every rank's `rank_main` in its own process (a file rendezvous); what each saved."""
    import torch.multiprocessing as mp

    (work / "rendezvous").unlink(missing_ok=True)
    init = f"file://{work / 'rendezvous'}"
    mp.spawn(rank_main, args=(world, init, str(model_dir), setup, str(work)), nprocs=world)
    return [torch.load(work / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _initial(model_dir: Path):
    from asyncrl.learner.megatron.weights import HFCheckpoint

    ck = HFCheckpoint(model_dir)
    return ((n, ck(n).float()) for n in ck.where)


def replayed_check(ranks: list, data: dict, top_k: int) -> dict:
    """The experts every rank's routers dispatched each token to (collate's layout, -1 where a
    rank did not run the row) against the recorded routes, as sets per layer."""
    b, t, width = data["routes"].shape
    want = data["routes"].long().view(b, t, -1, top_k).sort(-1).values
    recorded = (want != 255).all(-1)  # (token, layer) pairs the engine routed
    checked, wrong, ran = 0, 0, torch.zeros_like(recorded)
    for r in ranks:
        used = r["used"].view(b, t, -1, top_k)
        mine = (used >= 0).all(-1)
        ran |= mine
        keep = recorded & mine
        checked += int(keep.sum())
        wrong += int((used[keep] != want[keep]).any(-1).sum())
    real = data["attention_mask"].bool()[..., None].expand_as(recorded)
    return {
        "checked": checked,
        "wrong": wrong,
        "recorded": int(recorded.sum()),
        "unrun_real_tokens": int((real & ~ran).sum()),
    }


if __name__ == "__main__":
    main()

"""Real-shape learner step: Qwen2.5-1.5B, ~4k-token sequences packed into 32k-token micro-batches.

A Qwen2.5-1.5B-shaped model (hidden 1536, 28 layers, 12 heads / 2 KV heads, vocabulary 151,936,
tied embeddings) with random weights, bf16 on one GPU (fp32 on the CPU, at reduced size), and
one batch of synthetic groups of ~4k-token sequences (a 32-token prompt + response). Rows:

- the torch learner (`TorchLearner.step`: logprobs, PPO loss, backward, AdamW) with
  `actor.use_dynamic_bsz` packing under `--budget` real tokens per micro-batch, in bypass mode
  (the rollout logprobs are the old ones) and in decoupled mode with two mini-batches (two
  optimizer steps, so the proximal logprobs are recomputed in a no-grad pass first);
- a bare forward + masked policy-gradient loss + backward + clip + AdamW of the same packed
  micro-batches on the same model and optimizer (`_train_scale.bare_packed_step`);
- the Megatron learner (`megatron_train`, bypass, local layer spec: no Transformer Engine)
  on the same tokens, `--megatron-micro` sequences per micro-batch (it does not pack);
- `--also-budgets` repeats the bypass and bare rows at other budgets.

Each row: the median of `--repeats` steps after one warm-up, the peak GPU memory
(`torch.cuda.max_memory_allocated`, all that is resident). A row that runs out of GPU memory
says OOM; one that would not fit in `--time-budget` seconds is skipped.

Model FLOPs (activation recompute not counted): 6 (N_body T + V H R) for a forward + backward,
plus 2 (N_body T + V H R) for a recompute pass; N_body the non-embedding parameters, V H the LM
head's matmul (only the R positions that predict a response token are projected), T the real
tokens. Attention: 12 layers H L / 2 per token of a sequence of L tokens for forward + backward
(4 layers H L / 2 for a forward-only pass). MFU = FLOPs / median step seconds / the GPU's dense
bf16 peak (train.PEAK_BF16; `--peak-tflops`), with and without attention. `x bare` = the row's
model FLOP/s over the bare step's at the same budget (for the bypass learner: the time ratio).
Targets: the learner >= 40 % MFU and >= 0.9x bare on one H200. `--profile` (auto: when the
bypass learner misses the MFU target) prints one step's top kernels and GPU busy share.

    asyncrl bench shape [--budget 32768] [--also-budgets 16384] [--layers 28] [--seq-len 4096]
        [--groups 2] [--n 8] [--repeats 3] [--time-budget 240] [--profile auto|on|off]
    asyncrl bench shape --layers 2 --seq-len 512 --budget 2048   # a CPU dry run (fp32)
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _shape_parts as parts
import torch
from common import add_threads_flag, finish, headline, make_parser, print_table

TARGET_MFU, TARGET_VS_BARE = 0.40, 0.9
#: Sizes by where it runs: the real shape on a GPU, a reduced one on the CPU, CI's smoke size.
SIZES = {
    "gpu": dict(seq_len=4096, groups=2, n=8, budget=32_768, also="16384", repeats=3),
    "cpu": dict(layers=2, seq_len=512, groups=1, n=4, budget=1024, also="", repeats=1),
    "smoke": dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=2048,
                  seq_len=64, groups=2, n=2, budget=128, also="", repeats=1),
}  # fmt: skip


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def timed_row(name: str, step: Any, ctx: dict[str, Any]) -> dict[str, Any]:
    """`step()` once to warm up, then up to `repeats` timed calls (as many as the time budget
    leaves room for, at least one); the median seconds and the peak GPU memory. OOM: a row
    that says so, the memory freed."""
    cuda, clock = ctx["cuda"], ctx["clock"]
    row: dict[str, Any] = {"path": name, "status": "ok", "seconds": None, "peak_gib": None}
    if cuda:  # what is resident before the row (a leftover of an earlier one shows here)
        _free(cuda)
        torch.cuda.reset_peak_memory_stats()
        row["start_gib"] = torch.cuda.memory_allocated() / 2**30
    try:
        times = []
        for i in range(ctx["repeats"] + 1):
            _sync(cuda)
            start = time.perf_counter()
            step()
            _sync(cuda)
            times.append(time.perf_counter() - start)
            if i and clock.left() < times[-1] * 1.2:  # the next one would overrun the budget
                break
        row["all_seconds"] = times[1:] or times
        row["seconds"] = float(sorted(row["all_seconds"])[len(row["all_seconds"]) // 2])
    except torch.OutOfMemoryError:
        row["status"] = "OOM"
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    took = f"{row['seconds']:.3f} s/step" if row["seconds"] else ""
    used = f", peak {row['peak_gib']:.1f} GiB" if row["peak_gib"] else ""
    print(f"  {name}: {row['status']} {took}{used} ({clock.elapsed():.0f} s in)", flush=True)
    return row


def learner_extra(args: argparse.Namespace, mode: str, budget: int, rows: int) -> list[str]:
    """The torch learner's config overrides: packing under `budget`, the correction mode (with
    two mini-batches in decoupled mode, so the proximal logprobs are recomputed)."""
    extra = [f"algorithm.correction_mode={mode}", "actor.use_dynamic_bsz=true",
             f"actor.ppo_max_token_len_per_gpu={budget}"]  # fmt: skip
    if mode == "decoupled":
        extra.append(f"actor.ppo_mini_batch_size={max(1, rows // 2)}")
    if args.checkpointing:
        extra.append("actor_train.model_args.disable_gradient_checkpointing=false")
    if args.attn:
        extra.append(f"actor_train.model_args.attn_implementation={args.attn}")
    if args.compile:  # in place: the bare step then runs the compiled model too
        extra.append("actor.use_torch_compile=true")
    return extra


def torch_rows(ctx: dict[str, Any], budget: int, modes: list[str]) -> list[dict[str, Any]]:
    """The torch learner in each of `modes` at `budget` (bypass first: the bare step runs on its
    model and optimizer, and the profile on it)."""
    from _train_scale import build_learner, learner_config

    args, groups, out = ctx["args"], ctx["groups"], []
    rows = sum(g.n for g in groups)
    for mode in modes:
        if ctx["clock"].left() < ctx["estimate"]:
            out.append({"path": f"learner {mode}", "status": "skipped (time)", "budget": budget})
            continue
        cfg = learner_config(1, ctx["dtype"], learner_extra(args, mode, budget, rows))
        learner = build_learner(ctx["model_dir"], cfg, ctx["device"])
        row = timed_row(f"learner {mode}", lambda lr=learner: lr.step(groups), ctx)
        out.append(row | {"budget": budget, "recompute": mode == "decoupled"})
        if mode == "bypass" and row["status"] == "ok":
            ctx["estimate"] = max(ctx["estimate"], 2.5 * row["seconds"] + 10)
            maybe_profile(ctx, learner, row, budget)
            out.append(bare_row(ctx, learner, budget))
        del learner
        _free(ctx["cuda"])
    return out


def bare_row(ctx: dict[str, Any], learner: Any, budget: int) -> dict[str, Any]:
    """`_train_scale.bare_packed_step` on the learner's model and its own AdamW (the same
    update, no second optimizer state), over the batch the learner collates."""
    from _train_scale import bare_packed_step

    from asyncrl.learner.collate import collate

    data = collate(sorted(ctx["groups"], key=lambda g: g.group_id), learner.pad_id)
    data = data.to_torch(ctx["device"])
    data["response_mask"] = data["response_mask"].float()
    model, opt = learner.model, learner.optimizer
    row = timed_row("bare fwd+bwd+AdamW", lambda: bare_packed_step(model, opt, data, budget), ctx)
    return row | {"budget": budget, "recompute": False}


def maybe_profile(ctx: dict[str, Any], learner: Any, row: dict[str, Any], budget: int) -> None:
    """One more bypass step under the profiler: `--profile on`, or `auto` on a GPU when this
    row misses the MFU target and the time budget has room."""
    args = ctx["args"]
    if args.profile == "off" or budget != args.budget or "profile" in ctx:
        return
    if args.profile == "auto":
        mfu = ctx["flops"]["dense"] + ctx["flops"]["attention"]
        mfu = mfu / row["seconds"] / ctx["peak"] if ctx["peak"] else None
        if mfu is None or mfu >= TARGET_MFU or ctx["clock"].left() < 4 * row["seconds"] + 30:
            return
    groups = ctx["groups"]
    ctx["profile"] = parts.profile_summary(
        lambda: learner.step(groups), ctx["cuda"], args.profile_rows
    )
    title, lines = parts.profile_lines(ctx["profile"])
    print_table(title, ["kernel" if ctx["cuda"] else "op", "ms", "% of time", "calls"], lines)


def megatron_row(ctx: dict[str, Any]) -> dict[str, Any]:
    """The Megatron learner (bypass, local layer spec) on the same batch; a row that says why
    where it cannot run."""
    args = ctx["args"]
    row: dict[str, Any] = {"path": "megatron bypass (local, no TE)", "budget": args.budget,
                           "recompute": False, "micro_rows": args.megatron_micro}  # fmt: skip
    if not ctx["cuda"] or args.megatron == "off":
        return row | {"status": "skipped (needs a GPU)" if ctx["cuda"] is False else "off"}
    if ctx["clock"].left() < ctx["estimate"] + 30:
        return row | {"status": "skipped (time)"}
    try:
        learner = _megatron_learner(ctx)
    except Exception as e:  # noqa: BLE001 - megatron-core absent or refusing: the row says so
        return row | {"status": f"unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120]})"}
    groups = ctx["groups"]
    try:
        return timed_row(row["path"], lambda: learner.step(groups), ctx) | row
    finally:
        learner.close()


def _megatron_learner(ctx: dict[str, Any]) -> Any:
    import mfu

    args = ctx["args"]
    spec = argparse.Namespace(micro=args.megatron_micro, tp=1, impl="local")
    recompute = args.megatron_recompute
    strategy = {"recompute_granularity": recompute} if recompute else {}
    return mfu.make_learner(ctx["model_dir"], spec, ["algorithm.correction_mode=bypass"], strategy)


def _figures(rows: list[dict[str, Any]], ctx: dict[str, Any]) -> None:
    """Per row: model FLOPs, TFLOP/s, MFU with and without attention, x bare."""
    peak, fl = ctx["peak"], ctx["flops"]
    bare = {r["budget"]: r for r in rows if r["path"].startswith("bare") and r.get("seconds")}
    for r in rows:
        if not r.get("seconds"):
            continue
        scale = 4 / 3 if r.get("recompute") else 1.0
        dense, total = fl["dense"] * scale, (fl["dense"] + fl["attention"]) * scale
        r["tflops"] = total / r["seconds"] / 1e12
        r["mfu"] = total / r["seconds"] / peak if peak else None
        r["mfu_no_attention"] = dense / r["seconds"] / peak if peak else None
        r["tokens_per_s"] = ctx["tokens"] / r["seconds"]
    for r in rows:
        b = bare.get(r["budget"])
        r["x_bare"] = r["tflops"] / b["tflops"] if b and "tflops" in r else None


def _peak(args: argparse.Namespace, cuda: bool) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if not cuda:
        return None
    from train import PEAK_BF16

    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = make_parser(__doc__)
    for flag in ("layers", "hidden", "intermediate", "heads", "kv-heads", "vocab", "seq-len",
                 "groups", "n", "budget", "repeats"):  # fmt: skip
        p.add_argument(f"--{flag}", type=int, default=None)
    p.add_argument("--also-budgets", default=None, help="more budgets, e.g. 16384 (comma list)")
    p.add_argument("--modes", default="bypass,decoupled", help="torch learner modes to run")
    p.add_argument("--time-budget", type=float, default=240.0, help="seconds; later rows skip")
    p.add_argument("--profile", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--profile-rows", type=int, default=15)
    p.add_argument("--megatron", choices=["auto", "off"], default="auto")
    p.add_argument("--megatron-micro", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--megatron-recompute", choices=["selective", "full"], default=None)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing on")
    p.add_argument("--attn", default=None, help="attn_implementation (default: transformers')")
    p.add_argument("--compile", action="store_true", help="actor.use_torch_compile on")
    p.add_argument("--tf32", action="store_true",
                   help="TF32 for fp32 matmuls (e.g. the chunked LM head's fp32 weight gradient)")  # fmt: skip
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--workdir", type=Path, default=None, help="where the model dir is written")
    add_threads_flag(p)
    args = p.parse_args(argv)
    if args.hidden is not None:  # a narrower model keeps Qwen2.5's ratios and head size 128
        args.intermediate = args.intermediate or args.hidden * 35 // 6  # 8960 / 1536
        args.heads = args.heads or max(1, args.hidden // 128)
        args.kv_heads = args.kv_heads or (2 if args.heads % 2 == 0 else 1)
    where = "smoke" if args.smoke else "gpu" if torch.cuda.is_available() else "cpu"
    sizes = {**parts.QWEN25_1_5B, **SIZES["gpu"], **SIZES[where]}
    for key, value in sizes.items():
        if key in vars(args) and getattr(args, key) is None:
            setattr(args, key, value)
    args.also_budgets = args.also_budgets if args.also_budgets is not None else sizes["also"]
    return args


def shape_of(args: argparse.Namespace) -> dict[str, Any]:
    """The model's shape: QWEN25_1_5B with the sizes the flags set."""
    return {k: getattr(args, k, None) or v for k, v in parts.QWEN25_1_5B.items()}


def measure(args: argparse.Namespace, model_dir: Path, ctx: dict[str, Any]) -> list[dict]:
    """Every row, in order of importance (a later row is the first the time budget skips)."""
    modes = [m for m in args.modes.split(",") if m]
    rows = torch_rows(ctx, args.budget, modes)
    rows.append(megatron_row(ctx))
    if ctx["cuda"] and ctx["clock"].left() > 20:
        ctx["attention"] = parts.attention_costs(ctx["shape"], ctx["real"])
    for budget in (int(b) for b in args.also_budgets.split(",") if b):
        rows += torch_rows(ctx, budget, ["bypass"])
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "bf16") if cuda else ("cpu", "fp32")
    shape = shape_of(args)
    clock = parts.Clock(args.time_budget)
    if args.tf32 and cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    from asyncrl.threads import torch_threads

    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-shape-", dir=args.workdir) as tmp:
        model_dir = Path(tmp) / "model"
        torch_dtype = torch.bfloat16 if cuda else torch.float32
        build_s = parts.write_model_dir(model_dir, shape, device, torch_dtype)
        print(f"model: {shape} written in {build_s:.1f} s", flush=True)
        groups = parts.make_groups(args.groups, args.n, args.seq_len, shape["vocab"])
        real, resp = parts.batch_lengths(groups)
        ctx = {"args": args, "cuda": cuda, "device": device, "dtype": dtype, "clock": clock,
               "groups": groups, "model_dir": model_dir, "repeats": args.repeats, "shape": shape,
               "real": real, "tokens": float(real.sum()), "estimate": 0.0,
               "flops": parts.step_flops(shape, real, resp), "peak": _peak(args, cuda)}  # fmt: skip
        with torch_threads(0 if cuda else args.threads):
            rows = measure(args, model_dir, ctx)
    _figures(rows, ctx)
    report(rows, ctx, build_s)
    argv = sys.argv[1:] if argv is None else argv  # the command the result records
    return finish("shape", result(rows, ctx, build_s), args, parts.plot(rows, TARGET_MFU), argv)


def report(rows: list[dict[str, Any]], ctx: dict[str, Any], build_s: float) -> None:
    shape = ctx["shape"]
    where = torch.cuda.get_device_name(0) if ctx["cuda"] else "CPU"
    pct = lambda v: None if v is None else 100 * v  # noqa: E731
    print_table(
        f"learner step, Qwen2 {shape['layers']} layers x hidden {shape['hidden']}, vocabulary "
        f"{shape['vocab']}; {len(ctx['real'])} sequences, {ctx['tokens']:.0f} tokens (median "
        f"{int(sorted(ctx['real'])[len(ctx['real']) // 2])}); {where} {ctx['dtype']}",
        ["path", "budget", "s/step", "tok/s", "TFLOP/s", "MFU %", "MFU % no attn", "x bare",
         "peak GiB", "status"],
        [[r["path"], r["budget"], r.get("seconds"), r.get("tokens_per_s"), r.get("tflops"),
          pct(r.get("mfu")), pct(r.get("mfu_no_attention")), r.get("x_bare"), r.get("peak_gib"),
          r["status"]] for r in rows],
    )  # fmt: skip
    fl = ctx["flops"]
    print(f"model FLOPs a fwd+bwd: {fl['dense'] / 1e12:.4g} T dense 6 (N_body T + V H R), "
          f"{fl['attention'] / 1e12:.4g} T attention 12 layers H L / 2 per token (a recompute "
          f"pass adds a third of both); model written in {build_s:.1f} s")  # fmt: skip
    for line in target_lines(rows):
        print(line)
    if "attention" in ctx:
        a = ctx["attention"]
        print(f"attention fwd+bwd per step (measured at L = {a['median_len']}, scaled): "
              f"Megatron local {a['local_s']:.3g} s, flash (SDPA) {a['flash_s']:.3g} s: "
              f"lacking TE's fused attention costs ~{a['gap_s']:.3g} s a step")  # fmt: skip
    print(parts.NO_TE)


def target_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The targets beside this run's figures (the bypass learner at each budget measured)."""
    out = []
    for r in rows:
        if r["path"] != "learner bypass" or not r.get("seconds"):
            continue
        mfu, x = r.get("mfu"), r.get("x_bare")
        met = lambda v, t: "-" if v is None else "met" if v >= t else "MISSED"  # noqa: E731
        mfu_text = "n/a (no GPU peak)" if mfu is None else f"{100 * mfu:.1f} %"
        x_text = "n/a (bare did not run)" if x is None else f"{x:.3f}x"
        out.append(f"target at budget {r['budget']}: MFU >= {100 * TARGET_MFU:.0f} %: {mfu_text} "
                   f"({met(mfu, TARGET_MFU)}); learner >= {TARGET_VS_BARE}x bare: {x_text} "
                   f"({met(x, TARGET_VS_BARE)})")  # fmt: skip
    return out


def result(rows: list[dict[str, Any]], ctx: dict[str, Any], build_s: float) -> dict[str, Any]:
    args = ctx["args"]
    main_row = next((r for r in rows if r["path"] == "learner bypass" and r.get("seconds")), None)
    heads: dict[str, Any] = {}
    if main_row is not None:
        heads["learner_tokens_per_s"] = headline(main_row["tokens_per_s"], True, "tok/s")
        if main_row.get("mfu") is not None:
            heads["mfu"] = headline(main_row["mfu"], True, "")
            heads["mfu_no_attention"] = headline(main_row["mfu_no_attention"], True, "")
    ratio = next(
        (r["x_bare"] for r in rows if r["path"] == "learner bypass" and r.get("x_bare")), None
    )
    if ratio is not None:
        heads["learner_vs_bare"] = headline(ratio, True, "x")
    return {
        "shape": ctx["shape"], "device": ctx["device"], "dtype": ctx["dtype"],
        "sequences": len(ctx["real"]), "tokens": ctx["tokens"], "seq_len": args.seq_len,
        "groups": args.groups, "n": args.n, "budget": args.budget, "repeats": args.repeats,
        "checkpointing": args.checkpointing, "attn": args.attn, "compile": args.compile,
        "tf32": args.tf32, "peak_flops": ctx["peak"],
        "flops": ctx["flops"], "model_build_s": build_s, "rows": rows,
        "targets": {"mfu": TARGET_MFU, "learner_vs_bare": TARGET_VS_BARE},
        "target_lines": target_lines(rows), "attention_costs": ctx.get("attention"),
        "profile": ctx.get("profile"), "no_te_note": parts.NO_TE,
        "formula": "dense 6 (N_body T + V H R) a fwd+bwd, 2 (N_body T + V H R) a recompute "
                   "pass; attention 12 layers H L / 2 per token (fwd+bwd), a third for a recompute",
        "headline": heads,
    }  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())

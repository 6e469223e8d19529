"""Learner throughput: tokens/s of `TorchLearner.step` (and MFU on GPU).

One step = one rollout batch of synthetic groups (n responses per prompt, random tokens,
response lengths uniform in [L/2, L]): recompute the proximal logprobs (decoupled mode, the
default) → IS weights, RS, metrics → PPO loss, backward over micro-batches → AdamW. Side by
side with a plain PyTorch step on the same tokens and micro-batches (forward, masked
policy-gradient loss, backward, clip, AdamW: no recompute, no IS), with the learner in
bypass mode (no recompute), and in bypass mode without `actor.share_prompt_forward` (each
row's prompt and response in one forward, as the raw step does: half the kernel launches of
the shared prompt's two forwards, which a launch-bound GPU step pays for, against the
prompt's FLOPs once per group, which a CPU step saves). `x raw` is what the learner's extra
work costs.

MFU (GPU only): model FLOPs (6 N per trained token + 2 N per recomputed token, N = parameters,
attention ignored) / step time / the GPU's dense bf16 peak.

On the CPU every path runs on `--threads` torch threads (default 1: stable on a shared box).

Then the scale parts (bench/_train_scale.py): packed (`use_dynamic_bsz`, `--budget` real tokens
per micro-batch, laid into rows as long as the longest sequence: the CPU's dense block mask
never costs more than the padded batch's attention) vs padded learner on a log-normal
long-tail length distribution, real tokens/s
and the padded batch's padding fraction (target packed >= 1.5x); the packed learner vs a bare
packed fwd+bwd of the same real tokens (target >= 0.9x); FSDP2 on 2 CPU ranks vs 1 process,
rank 0's parameter + gradient + optimizer bytes (target <= 0.55x) and the step time; one packed
row of `--row-tokens` real tokens through the learner's varlen attention vs sdpa's dense
block-diagonal mask (fwd+bwd; target: varlen faster).

    asyncrl bench train [--smoke] [--groups 8] [--n 8] [--response-len 128] [--repeats 2]
                        [--threads 1] [--budget 512] [--row-tokens 8192]

`--shared-prompt` runs only the shared-prompt part (bench/_shared_prompt.py; its own result,
train_shared_prompt.json, with `--ragged` train_shared_prompt_ragged.json): the training
forward's fwd + bwd at several (prompt, response)
shapes, each group's prompt once (under a mask, or laid out causally), every row whole, and the
learner's rule (`actor.share_prompt_forward`) that picks among them (`--repeats`, default 3).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _shared_prompt as shared_prompt
import _train_scale as scale
import torch
from common import (
    add_threads_flag,
    build_model_dir,
    finish,
    headline,
    make_parser,
    median,
    print_table,
)

from asyncrl.threads import torch_threads

FULL_MODEL = dict(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4)  # embedded
SMOKE_MODEL = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
             "L40S": 362e12, "4090": 165e12}  # fmt: skip


def make_groups(groups: int, n: int, resp_len: int, vocab: int, seed: int = 0) -> list:
    """Response lengths uniform in [resp_len / 2, resp_len]."""
    return scale.synthetic_groups(
        groups, vocab, lambda rng: rng.integers(resp_len // 2, resp_len + 1, n), "bench", seed
    )


#: The learner's paths: correction mode and extra config overrides.
PATHS = {
    "decoupled": ("decoupled", []),
    "bypass": ("bypass", []),
    "bypass, unshared prompt": ("bypass", ["actor.share_prompt_forward=false"]),
}


def make_learner(model_dir: Path, mode: str, micro: int, device: str, dtype: str, extra=()):
    """The learner in correction `mode`, on `micro`-row micro-batches (the scale parts' own
    configuration, `_train_scale.learner_config`), with `extra` overrides."""
    cfg = scale.learner_config(micro, dtype, [f"algorithm.correction_mode={mode}", *extra])
    return scale.build_learner(model_dir, cfg, device)


def raw_step(model: Any, opt: Any, data: dict[str, torch.Tensor], micro: int) -> None:
    """The plain PyTorch step on the same batch: forward, masked PG loss, backward, AdamW."""
    model.train()
    opt.zero_grad(set_to_none=True)
    mask = data["response_mask"]
    resp = mask.shape[1]
    start = data["input_ids"].shape[1] - resp - 1
    for i in range(0, mask.shape[0], micro):
        rows = slice(i, i + micro)
        logits = model(input_ids=data["input_ids"][rows], attention_mask=data["attention_mask"][rows],
                       position_ids=data["position_ids"][rows], use_cache=False).logits  # fmt: skip
        logits = logits[:, start : start + resp].float()
        targets = data["input_ids"][rows, -resp:].unsqueeze(-1)
        logp = logits.gather(-1, targets).squeeze(-1) - logits.logsumexp(-1)
        loss = -(logp * data["advantages"][rows] * mask[rows]).sum() / mask.sum()
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def _time(fn, repeats: int, cuda: bool) -> float:
    times = []
    for _ in range(repeats + 1):  # first: warm-up
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return median(times[1:])


def measure(model_dir: Path, groups: list, micro: int, repeats: int) -> dict[str, Any]:
    from asyncrl.learner.collate import collate

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "bf16") if cuda else ("cpu", "fp32")
    seconds, learners = {}, {}
    for path, (mode, extra) in PATHS.items():
        learners[path] = learner = make_learner(model_dir, mode, micro, device, dtype, extra)
        seconds[path] = _time(lambda lr=learner: lr.step(groups), repeats, cuda)
    model = learners["bypass"].model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    data = collate(groups, 0).to_torch(device)
    data["response_mask"] = data["response_mask"].float()
    seconds["raw"] = _time(lambda: raw_step(model, opt, data, micro), repeats, cuda)
    trained = float(data["response_mask"].sum())
    processed = float(data["attention_mask"].sum())
    params = sum(p.numel() for p in model.parameters())
    return {"device": device, "dtype": dtype, "seconds": seconds, "trained_tokens": trained,
            "processed_tokens": processed, "params": params, "rows": int(data["input_ids"].shape[0]),
            "padded_width": int(data["input_ids"].shape[1])}  # fmt: skip


def _flops(m: dict[str, Any], path: str) -> float:
    recompute = 2 if path == "decoupled" else 0
    return (6 + recompute) * m["params"] * m["processed_tokens"]


def _peak() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def _rows(m: dict[str, Any]) -> list[dict[str, Any]]:
    peak, out = _peak(), []
    for mode, secs in m["seconds"].items():
        flops = _flops(m, "bypass" if mode == "raw" else mode)
        out.append({
            "path": mode if mode == "raw" else f"learner ({mode})", "seconds": secs,
            "trained_tokens_per_s": m["trained_tokens"] / secs,
            "processed_tokens_per_s": m["processed_tokens"] / secs,
            "x_raw": m["seconds"]["raw"] / secs, "gflops": flops / secs / 1e9,
            "mfu": None if peak is None else flops / secs / peak,
        })  # fmt: skip
    return out


def _plot(rows: list[dict]):
    def draw(fig: Any) -> None:
        ax = fig.subplots()
        ax.barh([r["path"] for r in rows], [r["trained_tokens_per_s"] for r in rows])
        ax.set_xlabel("trained (response) tokens / s")
        ax.set_title("learner step throughput")

    return draw


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--groups", type=int, default=None)
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--response-len", type=int, default=None)
    parser.add_argument("--micro", type=int, default=8, help="per-device micro-batch rows")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: tiny)")
    parser.add_argument("--budget", type=int, default=512, help="packed tokens per micro-batch")
    parser.add_argument("--row-tokens", type=int, default=None, help="the varlen part's row")
    parser.add_argument("--shared-prompt", action="store_true", help="only the shared-prompt part")
    parser.add_argument("--ragged", action="store_true", help="shared-prompt part: ragged lengths")
    add_threads_flag(parser)
    args = parser.parse_args(argv)
    if args.shared_prompt:
        return _shared_prompt_main(args, argv)
    groups_n = args.groups or (2 if args.smoke else 8)
    n, resp = args.n or (4 if args.smoke else 8), args.response_len or (16 if args.smoke else 128)
    repeats = args.repeats or (1 if args.smoke else 2)
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-train-") as tmp:
        spec = SMOKE_MODEL if args.smoke else FULL_MODEL
        model_dir = args.model or build_model_dir(Path(tmp) / "model", **spec)
        vocab = _vocab(model_dir)
        with torch_threads(args.threads):
            m = measure(model_dir, make_groups(groups_n, n, resp, vocab), args.micro, repeats)
            ragged = scale.ragged_groups(groups_n, n, resp, vocab)
            pk = scale.measure_packing(model_dir, ragged, args.micro, args.budget, repeats)
            fs = scale.measure_fsdp(model_dir, make_groups(groups_n, n, resp, vocab), args.micro,
                                    repeats)  # fmt: skip
            vl = scale.measure_varlen(model_dir, args.row_tokens or (512 if args.smoke else 8192),
                                      repeats)  # fmt: skip
    rows = _rows(m)
    print_table(
        f"learner step, {m['rows']} sequences x {m['padded_width']} (padded), "
        f"{m['params'] / 1e6:.2f}M params, {m['device']} {m['dtype']}",
        ["path", "s/step", "trained tok/s", "processed tok/s", "x raw", "GFLOP/s", "MFU"],
        [[r["path"], r["seconds"], r["trained_tokens_per_s"], r["processed_tokens_per_s"],
          r["x_raw"], r["gflops"], r["mfu"]] for r in rows],
    )  # fmt: skip
    _print_scale(pk, fs, vl)
    main_row = rows[0]
    result = {
        **{k: v for k, v in m.items() if k != "seconds"},
        "threads": args.threads, "groups": groups_n, "n": n, "response_len": resp,
        "micro": args.micro, "rows": rows,
        "headline": {
            "learner_trained_tokens_per_s": headline(main_row["trained_tokens_per_s"], True, "tok/s"),
            "learner_vs_raw": headline(main_row["x_raw"], True, "x"),
            "packed_vs_padded": headline(pk["tokens_per_s"]["packed"] / pk["tokens_per_s"]["padded"], True, "x"),
            "packed_learner_vs_bare": headline(pk["seconds"]["bare_packed"] / pk["seconds"]["packed"], True, "x"),
            "fsdp2_state_per_rank_ratio": headline(fs["state_ratio"], False, "x"),
            "varlen_vs_dense_mask": headline(vl["speedup"], True, "x"),
        },
        "packing": pk, "fsdp2": fs, "varlen": vl,
    }  # fmt: skip
    if main_row["mfu"] is not None:
        result["headline"]["mfu"] = headline(main_row["mfu"], True, "")
    return finish("train", result, args, _plot(rows), argv)


def _shared_prompt_main(args: Any, argv: list[str] | None) -> int:
    """`--shared-prompt`: the shared-prompt part alone (bench/_shared_prompt.py)."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-train-") as tmp:
        spec = SMOKE_MODEL if args.smoke else FULL_MODEL
        model_dir = args.model or build_model_dir(Path(tmp) / "model", **spec)
        with torch_threads(args.threads):
            m = shared_prompt.measure(
                model_dir, args.n or 8, args.repeats or (1 if args.smoke else 3), args.smoke,
                args.ragged,
            )  # fmt: skip
    shared_prompt.print_result(m, print_table)
    worst = max(max(r["auto_vs_best"], r["hf_auto_vs_best"]) for r in m["rows"])
    result = {**m, "threads": args.threads,
              "headline": {"auto_vs_best_worst": headline(worst, False, "x")}}  # fmt: skip
    argv = list(sys.argv[1:] if argv is None else argv)  # the command names the part
    name = "train_shared_prompt" + ("_ragged" if args.ragged else "")
    return finish(name, result, args, None, argv, bench="train")


def _print_scale(pk: dict[str, Any], fs: dict[Any, Any], vl: dict[str, Any]) -> None:
    t = pk["tokens_per_s"]
    print_table(
        f"packed vs padded: {pk['rows']} rows, lengths median {pk['median_len']:.0f} max "
        f"{pk['max_len']} (log-normal), padding {100 * pk['pad_fraction']:.0f} % of the padded batch",
        ["path", "s/step", "real tok/s", "x padded", "target"],
        [["learner padded", pk["seconds"]["padded"], t["padded"], 1.0, ""],
         ["learner packed", pk["seconds"]["packed"], t["packed"], t["packed"] / t["padded"], ">= 1.5x"],
         ["bare packed fwd+bwd", pk["seconds"]["bare_packed"], t["bare_packed"],
          t["bare_packed"] / t["padded"], "learner >= 0.9x bare"]],
    )  # fmt: skip
    print_table(
        "FSDP2: 2 CPU ranks (gloo) vs 1 process, rank 0's params + grads + optimizer state",
        ["ranks", "s/step", "state MB", "x 1 process", "target"],
        [[1, fs[1]["seconds"], fs[1]["state_bytes"] / 1e6, 1.0, ""],
         [2, fs[2]["seconds"], fs[2]["state_bytes"] / 1e6, fs["state_ratio"], "<= 0.55x"]],
    )  # fmt: skip
    print_table(
        f"attention on one packed row of {vl['row_tokens']} tokens ({vl['sequences']} sequences, "
        f"longest {vl['max_len']}): fwd + bwd",
        ["attention", "s", "x dense mask", "target"],
        [["sdpa, dense block mask", vl["seconds"]["dense_mask"], 1.0, ""],
         ["varlen (per sequence)", vl["seconds"]["varlen"], vl["speedup"], "> 1x"]],
    )  # fmt: skip


def _vocab(model_dir: Path) -> int:
    import json

    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


if __name__ == "__main__":
    raise SystemExit(main())

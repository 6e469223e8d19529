"""Rollout IS + RS + mismatch metrics and the policy loss on realistic shapes: time, peak memory.

What the learner runs once per rollout batch (`TorchLearner._prepare`): rollout importance
weights with every `mismatch/` metric (token, sequence and geometric levels), rejection
sampling with three criteria, and the vanilla PPO policy loss (forward + backward) weighted by
the IS weights. Side by side in one run, against two references of the same shape:

- bare weights: `exp(clamp(old - rollout)).clamp(max=2) * mask`, the least any IS can cost
  (so `x bare` is the price of the metrics, the veto and the checks);
- the policy loss forward + backward, which every step pays anyway (`x loss`).

Inputs: response lengths uniform in [T/4, T], rollout logprobs -Exp(1), old = rollout +
N(0, 0.05) with a few catastrophic tokens (the veto has work). Time: best of `--repeats`.
Peak memory is the extra peak above the inputs: CUDA allocator stats on GPU; on the CPU the
peak RSS (reset per op) of a separate process whose allocator returns freed memory at once.

On the CPU the ops run on `--threads` torch threads (default 1: stable on a shared box).

    asyncrl bench importance [--smoke] [--shapes 256x4096,64x16384] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from common import (
    PeakMemory,
    add_threads_flag,
    finish,
    headline,
    make_parser,
    print_table,
    strict_malloc,
    timed,
)

from asyncrl.algo.importance import RolloutIS, apply_rollout_is
from asyncrl.algo.losses import get_policy_loss
from asyncrl.algo.rejection import rejection_mask
from asyncrl.threads import torch_threads

FULL_SHAPES = "256x4096,64x16384"
SMOKE_SHAPES = "16x256"
RS_CRITERIA = [("token_k3", None, 2.0), ("seq_mean_k3", None, 0.05), ("seq_max_k2", None, 8.0)]


@dataclass
class Inputs:
    old: torch.Tensor
    rollout: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    log_prob: torch.Tensor  # requires grad: the loss's backward reaches it


def make_inputs(batch: int, seq: int, device: torch.device, seed: int = 0) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, seq // 4), seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).float()
    rollout = -torch.empty(batch, seq).exponential_(1.0, generator=g)
    old = rollout + 0.05 * torch.randn(batch, seq, generator=g)
    old[torch.rand(batch, seq, generator=g) < 1e-5] -= 12.0  # catastrophic: vetoed rows
    advantages = torch.randn(batch, 1, generator=g).expand(batch, seq).contiguous()
    log_prob = old + 0.01 * torch.randn(batch, seq, generator=g)
    to = dict(device=device)
    return Inputs(
        old.to(**to),
        rollout.to(**to),
        mask.to(**to),
        advantages.to(**to),
        log_prob.to(**to).requires_grad_(),
    )


def _settings(level: str, mode: str) -> RolloutIS:
    """The config defaults (threshold 2, veto 1e-4) at one level and mode."""
    return RolloutIS(level=level, mode=mode, threshold=2.0, veto_threshold=1e-4)


TOKEN_TRUNCATE = _settings("token", "truncate")
SEQUENCE_TRUNCATE = _settings("sequence", "truncate")
GEOMETRIC_CLIP = _settings("geometric", "clip")


def _is(x: Inputs, settings: RolloutIS) -> Any:
    return apply_rollout_is(x.old, x.rollout, x.mask, settings)


def operations(x: Inputs) -> dict[str, Callable[[], Any]]:
    loss_fn = get_policy_loss("vanilla")
    weights, _ = _is(x, TOKEN_TRUNCATE)

    def loss_fwd_bwd() -> None:
        x.log_prob.grad = None
        loss, _ = loss_fn(x.log_prob, x.old, x.advantages, x.mask, "token-mean", rollout_is_weights=weights)  # fmt: skip
        loss.backward()

    def learner_prepare() -> None:  # IS + RS + metrics, as `TorchLearner._prepare` runs them
        _is(x, TOKEN_TRUNCATE)
        rejection_mask(x.old, x.rollout, x.mask, RS_CRITERIA)

    return {
        "bare weights": lambda: torch.exp((x.old - x.rollout).clamp(-20, 20)).clamp(max=2) * x.mask,
        "IS token/truncate": lambda: _is(x, TOKEN_TRUNCATE),
        "IS sequence/truncate": lambda: _is(x, SEQUENCE_TRUNCATE),
        "IS geometric/clip": lambda: _is(x, GEOMETRIC_CLIP),
        "RS 3 criteria": lambda: rejection_mask(x.old, x.rollout, x.mask, RS_CRITERIA),
        "IS + RS + metrics": learner_prepare,
        "policy loss fwd+bwd": loss_fwd_bwd,
    }


def measure_shape(batch: int, seq: int, repeats: int, device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    x = make_inputs(batch, seq, device)
    rows = {}
    for name, fn in operations(x).items():
        rows[name] = {"seconds": min(timed(fn, repeats, warmup=1, sync=sync))}  # best of
    bare, loss = rows["bare weights"]["seconds"], rows["policy loss fwd+bwd"]["seconds"]
    for row in rows.values():
        row["x_bare"] = row["seconds"] / bare
        row["x_loss"] = row["seconds"] / loss
        row["mtokens_per_s"] = batch * seq / row["seconds"] / 1e6
    return {
        "batch": batch,
        "seq_len": seq,
        "valid_tokens": int(x.mask.sum()),
        "tensor_bytes": batch * seq * 4,
        "ops": rows,
    }


def measure_peaks(shape: dict[str, Any], device: torch.device, threads: int) -> None:
    """Extra peak memory of every op: in process on CUDA (allocator stats); on the CPU in a
    fresh process with `strict_malloc` from the start (exact, and no effect on the timings)."""
    if device.type == "cuda":
        peaks = _peaks(shape["batch"], shape["seq_len"], device)
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "--_peaks"]
        cmd += [str(shape["batch"]), str(shape["seq_len"]), str(threads)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        peaks = json.loads(done.stdout.strip().splitlines()[-1])
    for name, nbytes in peaks.items():
        shape["ops"][name]["peak_bytes"] = nbytes


def _peaks(batch: int, seq: int, device: torch.device) -> dict[str, int | None]:
    x, out = make_inputs(batch, seq, device), {}
    for name, fn in operations(x).items():
        fn()  # warm: lazy initialisation is not the op's own memory
        with PeakMemory(device.type == "cuda") as peak:
            fn()
        out[name] = peak.bytes
    return out


def _table(shape: dict[str, Any]) -> None:
    unit = shape["tensor_bytes"]
    rows = [
        [
            name, 1e3 * r["seconds"], r["mtokens_per_s"], r["x_bare"], r["x_loss"],
            None if r["peak_bytes"] is None else r["peak_bytes"] / 2**20,
            None if r["peak_bytes"] is None else r["peak_bytes"] / unit,
        ]
        for name, r in shape["ops"].items()
    ]  # fmt: skip
    print_table(
        f"{shape['batch']} x {shape['seq_len']} tokens ({shape['valid_tokens']:,} valid)",
        ["op", "ms", "Mtok/s", "x bare", "x loss", "peak MB", "peak/[B,T]f32"],
        rows,
    )


def _plot(shapes: list[dict[str, Any]]):
    def draw(fig: Any) -> None:
        axes = fig.subplots(1, 2)
        names = list(shapes[0]["ops"])
        width = 0.8 / len(shapes)
        for i, s in enumerate(shapes):
            label = f"{s['batch']}x{s['seq_len']}"
            xs = [j + i * width for j in range(len(names))]
            axes[0].barh(xs, [1e3 * s["ops"][n]["seconds"] for n in names], width, label=label)
            peak = [(s["ops"][n]["peak_bytes"] or 0) / 2**20 for n in names]
            axes[1].barh(xs, peak, width, label=label)
        for ax, title in zip(axes, ("time (ms)", "extra peak memory (MB)")):
            ax.set_yticks(range(len(names)))
            ax.set_yticklabels(names if ax is axes[0] else [])
            ax.set_title(title)
            ax.legend()

    return draw


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--shapes", default=None, help="BxT,... (default 256x4096,64x16384)")
    parser.add_argument("--repeats", type=int, default=None)
    add_threads_flag(parser)
    args = parser.parse_args(argv)
    spec = args.shapes or (SMOKE_SHAPES if args.smoke else FULL_SHAPES)
    repeats = args.repeats or (2 if args.smoke else 5)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = []
    with torch_threads(args.threads):
        for item in spec.split(","):
            batch, seq = (int(v) for v in item.lower().split("x"))
            shapes.append(measure_shape(batch, seq, repeats, device))
        for shape in shapes:
            measure_peaks(shape, device, args.threads)
            _table(shape)
    main_ops = shapes[0]["ops"]
    prepare = main_ops["IS + RS + metrics"]
    result = {
        "device": str(device),
        "threads": args.threads,
        "repeats": repeats,
        "shapes": shapes,
        "headline": {
            "is_rs_metrics_ms": headline(1e3 * prepare["seconds"], False, "ms"),
            "is_token_ms": headline(1e3 * main_ops["IS token/truncate"]["seconds"], False, "ms"),
            "policy_loss_ms": headline(1e3 * main_ops["policy loss fwd+bwd"]["seconds"], False),
            "is_rs_vs_loss": headline(prepare["x_loss"], False, "x"),
            "is_rs_peak_mb": headline((prepare["peak_bytes"] or 0) / 2**20, False, "MB"),
        },
    }
    return finish("importance", result, args, _plot(shapes), argv)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_peaks":  # the CPU peak-memory child
        strict_malloc()
        torch.set_num_threads(int(sys.argv[4]))
        print(json.dumps(_peaks(int(sys.argv[2]), int(sys.argv[3]), torch.device("cpu"))))
    else:
        raise SystemExit(main())

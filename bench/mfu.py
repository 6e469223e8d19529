"""MFU of one Megatron learner training step (`megatron_train`, one GPU, bf16).

One step = one rollout batch of synthetic groups (bench/train.py's generator): recompute the
proximal logprobs with a forward-only pipeline pass, IS / rejection / metrics, then the PPO
loss over micro-batches through Megatron's schedule, DDP and the Megatron optimizer.

Model FLOPs, as bench/train.py counts them for the torch learner so the two compare: 6 N per
processed token (forward + backward) + 2 N per recomputed token (decoupled mode), N = all
parameters, attention ignored. MFU = FLOPs / median step time / the GPU's dense bf16 peak
(`--peak-tflops` overrides the table). Needs a CUDA GPU and megatron-core.

    asyncrl bench mfu [--smoke] [--groups 8] [--n 8] [--response-len 512] [--repeats 3]
        [--tp 1] [--impl auto|local|transformer_engine]
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from common import build_model_dir, finish, headline, make_parser, median, print_table
from train import PEAK_BF16, make_groups

FULL_MODEL = dict(hidden_size=1024, intermediate_size=2816, num_layers=12, num_heads=16,
                  num_kv_heads=4, max_position_embeddings=4096)  # fmt: skip
SMOKE_MODEL = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4)


def make_learner(
    model_dir: Path, args: Any, extra: Sequence[str] = (), strategy: dict | None = None
) -> Any:
    """The Megatron learner on GPU 0 (`args`: micro, tp, impl); `extra` config overrides and
    `strategy` strategy_config keys on top (bench/shape.py: bypass mode, recompute)."""
    from asyncrl.config import load_config
    from asyncrl.learner.megatron.learner import MegatronLearner

    cfg = load_config(None, [
        "actor_train.strategy_args.strategy_name=megatron_train",
        "actor_train.model_args.dtype=bf16", "actor_train.device_mapping=[0]",
        f"actor_train.training_args.per_device_train_batch_size={args.micro}",
        "actor_train.training_args.learning_rate=1e-6", *extra,
    ])  # fmt: skip
    cfg.actor_train.strategy_args.strategy_config = {
        "tensor_model_parallel_size": args.tp, "transformer_impl": args.impl, "use_bridge": False,
        **(strategy or {}),
    }  # fmt: skip
    return MegatronLearner(model_dir, cfg.actor_train, cfg.actor, cfg.algorithm,
                           temperature=1.0, total_steps=100)  # fmt: skip


def measure(learner: Any, groups: list, repeats: int) -> dict[str, Any]:
    from asyncrl.learner.collate import collate

    times = []
    for i in range(repeats + 1):  # the first step warms up kernels and allocator
        torch.cuda.synchronize()
        start = time.perf_counter()
        learner.step(groups)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    data = collate(groups, 0)
    params = sum(p.numel() for chunk in learner.local.chunks for p in chunk.parameters())
    return {"seconds": median(times), "all_seconds": times, "params": params,
            "processed_tokens": float(data.attention_mask.sum()),
            "trained_tokens": float(data.response_mask.sum())}  # fmt: skip


def peak_flops(override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--impl", default="auto", choices=["auto", "local", "transformer_engine"])
    parser.add_argument("--peak-tflops", type=float, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("asyncrl bench mfu: needs a CUDA GPU (none here)")
        return 2
    if args.smoke:
        args.groups, args.n, args.response_len, args.repeats = 2, 4, 64, 2
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(Path(tmp) / "model", **spec)
        learner = make_learner(model_dir, args)
        vocab = learner.local.vocab_size
        groups = make_groups(args.groups, args.n, args.response_len, vocab)
        m = measure(learner, groups, args.repeats)
        learner.close()
    flops = 8 * m["params"] * m["processed_tokens"]  # 6N train + 2N recompute per token
    peak = peak_flops(args.peak_tflops)
    mfu = None if peak is None else flops / m["seconds"] / peak
    print_table("Megatron learner step", ["params", "tokens", "s/step", "TFLOP/s", "MFU"],
                [[m["params"], m["processed_tokens"], m["seconds"], flops / m["seconds"] / 1e12,
                  mfu]])  # fmt: skip
    print(f"MFU: {'n/a (unknown GPU peak)' if mfu is None else f'{100 * mfu:.1f}%'} "
          f"on {torch.cuda.get_device_name(0)}")  # fmt: skip
    result = {"config": vars(args) | {"model": spec}, "measure": m,
              "headline": {"tokens_per_s": headline(m["processed_tokens"] / m["seconds"], True,
                                                    "tok/s")}}  # fmt: skip
    if mfu is not None:
        result["headline"]["mfu"] = headline(mfu, True, "")
    return finish("mfu", result, args, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""Weight sync: asyncrl's bucketed broadcast into a real engine vs raw torch.distributed.broadcast.

asyncrl: the real `WeightSender` (learner = rank 0) pushes a model's full state dict into a
real hf engine server process (rank 1) exactly as the loop does: pause (in_place) → per bucket
flatten, POST `/update_weights_from_distributed`, broadcast, the engine loads it into its model
→ continue, version bump and cache flush on the last bucket. Time = `SyncStats.seconds`.

Both load formats are measured: `flattened_bucket` (one uint8 buffer per bucket, packed into a
reused staging buffer and copied into the parameters on arrival) and per-tensor broadcasts
(`load_format` None, received straight into the engine's parameters). The loop's `auto` picks
per bucket on gloo (per-tensor when the tensors average >= 1 MiB, as every bucket of this model
does) and flattened on NCCL/HCCL; the target applies to that path.

raw: two fresh processes in a plain `init_process_group` broadcast the same bytes in the same
bucket sizes (one preallocated uint8 tensor per bucket, no HTTP, no copies), closed by a
barrier so the last byte has arrived. All paths run alternately, bucket size by bucket size.

gloo over loopback on the CPU; with two or more GPUs the engine sits on cuda:1 and both paths
use NCCL (one GPU cannot hold both ends of an NCCL broadcast, so a single GPU stays on gloo).
Target: asyncrl >= 0.8x raw GB/s at the loop's default bucket size (256 MB).

LoRA row: the same model wrapped by peft (rank `--lora-rank`, all-linear, a trained-looking
adapter: B random, not zero) synced both ways at the default bucket size and `auto` format:
`merged` full weights (what `weight_sync.lora_sync: merge` sends) vs the `adapter` alone
(`lora_sync: adapter`: A and scale·B per layer; the engine recomputes W0 + B·A). Bytes and
seconds per sync, median over the repeats. `native` (`lora_sync: native`, SGLang's own LoRA
path): the learner's part only, the adapter written as a PEFT directory; SGLang's load of it
is not measured here.

    asyncrl bench weight-sync [--smoke] [--buckets-mb 4,16,64,256] [--repeats 4] [--lora-rank 16]
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import build_model_dir, finish, headline, make_parser, median, print_table

from asyncrl.weights.buckets import bucketize, flat_layout

TARGET = 0.8
DEFAULT_BUCKET_MB = 256.0
FULL_MODEL = dict(hidden_size=1024, intermediate_size=2816, num_layers=12, num_heads=16,
                  num_kv_heads=4)  # fmt: skip
SMOKE_MODEL = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4)


def backend() -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"


def bucket_bytes(named: list[tuple[str, torch.Tensor]], limit: int) -> list[int]:
    """The flattened size of every bucket the WeightSender sends for `limit`."""
    return [
        flat_layout([t.dtype for _, t in b], [t.shape for _, t in b])[1]
        for b in bucketize(named, limit)
    ]


# -- raw: two processes, driven line by line over stdin ----------------------------------------
def _raw_main(rank: int, port: int, kind: str) -> None:
    import torch.distributed as dist

    device = torch.device("cuda", rank) if kind == "nccl" else torch.device("cpu")
    if kind == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(kind, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffers: dict[int, torch.Tensor] = {}
    for line in sys.stdin:
        sizes = json.loads(line)
        if not sizes:
            break
        bufs = [
            buffers.setdefault(s, torch.ones(s, dtype=torch.uint8, device=device)) for s in sizes
        ]
        dist.barrier()
        start = _now(kind)
        for buf in bufs:
            dist.broadcast(buf, src=0)
        dist.barrier()
        if rank == 0:
            print(json.dumps({"seconds": _now(kind) - start}), flush=True)
    dist.destroy_process_group()


def _now(kind: str) -> float:
    import time

    if kind == "nccl":
        torch.cuda.synchronize()
    return time.perf_counter()


class RawPair:
    def __init__(self, kind: str) -> None:
        from asyncrl.net import free_port

        port, env = free_port(), {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
        cmd = [sys.executable, os.path.abspath(__file__), "--_raw"]
        self.procs = [
            subprocess.Popen([*cmd, str(r), str(port), kind], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
            for r in (0, 1)
        ]  # fmt: skip

    def run(self, sizes: list[int]) -> float:
        for p in self.procs:
            p.stdin.write(json.dumps(sizes) + "\n")
            p.stdin.flush()
        line = self.procs[0].stdout.readline()
        if not line:
            raise RuntimeError("raw broadcast process died (see its stderr above)")
        return float(json.loads(line)["seconds"])

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.stdin.write("[]\n")
                p.stdin.close()
        for p in self.procs:
            p.wait(timeout=30)


# -- asyncrl: the real sender into a real engine --------------------------------------------------
FORMATS = {"flattened": "flattened_bucket", "per-tensor": None}  # label -> load_format


async def _measure(url: str, named, sizes_mb: list[float], repeats: int, kind: str) -> list[dict]:
    from asyncrl.engine.client import EngineClient
    from asyncrl.weights.sync import WeightSender

    client, sender = EngineClient(url), WeightSender(timeout_s=300)
    await sender.init_group([client], backend=kind)
    raw = RawPair(kind)
    rows, version = [], 0
    try:
        for mb in sizes_mb:
            limit, trials = int(mb * 2**20), {label: [] for label in [*FORMATS, "raw"]}
            sizes = bucket_bytes(named, limit)
            for _ in range(repeats + 1):  # the first round warms every path up, not counted
                for label, fmt in FORMATS.items():
                    version += 1
                    stats = await sender.sync(
                        named, version, bucket_bytes=limit, load_format=fmt, pause_mode="in_place"
                    )
                    trials[label].append((stats.seconds, stats.bytes))
                trials["raw"].append((raw.run(sizes), sum(sizes)))
            rows.append(_row(mb, len(sizes), {k: v[1:] for k, v in trials.items()}))
    finally:
        raw.close()
        await sender.close()
        await client.close()
    return rows


def _row(mb: float, buckets: int, trials: dict[str, list[tuple[float, int]]]) -> dict:
    paths = {}
    for label, runs in trials.items():
        seconds, nbytes = median([t for t, _ in runs]), runs[0][1]
        paths[label] = {"seconds": seconds, "bytes": nbytes, "gb_per_s": nbytes / seconds / 1e9,
                        "trials": [t for t, _ in runs]}  # fmt: skip
    for path in paths.values():
        path["vs_raw"] = path["gb_per_s"] / paths["raw"]["gb_per_s"]
    return {"bucket_mb": mb, "buckets": buckets, "bytes": paths["raw"]["bytes"], "paths": paths}


def _plot(rows: list[dict]):
    def draw(fig: Any) -> None:
        ax = fig.subplots()
        xs = [r["bucket_mb"] for r in rows]
        for label, style in (("flattened", "o-"), ("per-tensor", "^-"), ("raw", "s--")):
            ys = [r["paths"][label]["gb_per_s"] for r in rows]
            ax.plot(xs, ys, style, label="raw broadcast" if label == "raw" else f"asyncrl {label}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bucket size (MB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"weight sync, {rows[0]['bytes'] / 2**20:.0f} MB of weights")
        ax.legend()

    return draw


def _table(rows: list[dict], kind: str) -> None:
    print_table(
        f"weight sync ({kind}): asyncrl WeightSender -> engine vs raw broadcast of the same bytes",
        ["bucket MB", "buckets", "path", "MB", "seconds", "GB/s", "x raw"],
        [[r["bucket_mb"], r["buckets"], label, p["bytes"] / 2**20, p["seconds"], p["gb_per_s"],
          p["vs_raw"]] for r in rows for label, p in r["paths"].items()],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--buckets-mb", default=None, help="comma-separated bucket sizes in MB")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the LoRA row")
    args = parser.parse_args(argv)
    sizes_mb = [float(v) for v in (args.buckets_mb or ("0.0625,1" if args.smoke else "4,16,64,256")).split(",")]  # fmt: skip
    repeats = args.repeats or (2 if args.smoke else 4)
    kind = backend()
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-ws-") as tmp:
        spec = SMOKE_MODEL if args.smoke else FULL_MODEL
        model_dir = build_model_dir(Path(tmp) / "model", **spec)
        rows, lora = _run(model_dir, sizes_mb, repeats, kind, args.lora_rank)
    _table(rows, kind)
    print_table(
        f"LoRA rank {args.lora_rank} sync ({kind}, {DEFAULT_BUCKET_MB:g} MB buckets, per sync)",
        ["what is sent", "MB", "seconds"],
        [
            [k, lora[k]["bytes"] / 2**20, lora[k]["seconds"]]
            for k in ("merged", "adapter", "native")
        ],
    )
    ref = min(rows, key=lambda r: abs(r["bucket_mb"] - DEFAULT_BUCKET_MB))
    label = "per-tensor" if kind == "gloo" else "flattened"  # what load_format auto picks
    path = ref["paths"][label]
    met = path["vs_raw"] >= TARGET
    result = {
        "backend": kind, "repeats": repeats, "rows": rows, "default_path": label,
        "lora": {"rank": args.lora_rank, **lora},
        "target": {"vs_raw_at_default_bucket": TARGET}, "met": {"vs_raw_at_default_bucket": met},
        "headline": {
            "vs_raw": headline(path["vs_raw"], True, "x"),
            "asyncrl_gb_per_s": headline(path["gb_per_s"], True, "GB/s"),
            "flattened_vs_raw": headline(ref["paths"]["flattened"]["vs_raw"], True, "x"),
            "lora_adapter_sync_seconds": headline(lora["adapter"]["seconds"], False, "s"),
            "lora_sync_bytes_ratio": headline(lora["bytes_ratio"], True, "x"),
        },
    }  # fmt: skip
    print(f"\ntarget asyncrl ({label}, the {kind} default) >= {TARGET}x raw at "
          f"{ref['bucket_mb']:g} MB buckets: {path['vs_raw']:.2f}x -> {'met' if met else 'MISSED'}")  # fmt: skip
    return finish("weight_sync", result, args, _plot(rows), argv)


def _run(
    model_dir: Path, sizes_mb: list[float], repeats: int, kind: str, rank: int
) -> tuple[list[dict], dict]:
    from transformers import AutoModelForCausalLM

    from asyncrl.engine.hf.launch import launch_hf_server

    device = "cuda:0" if kind == "nccl" else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    named = [(n, t.detach()) for n, t in model.state_dict().items()]
    merged, adapter = _lora_tensors(model, rank)
    extra = ["--device", "cuda:1"] if kind == "nccl" else []
    with launch_hf_server(model_dir, extra_args=extra, timeout_s=300) as handle:
        rows = asyncio.run(_measure(handle.url, named, sizes_mb, repeats, kind))
        lora = asyncio.run(_measure_lora(handle.url, merged, adapter, repeats, kind))
    lora["native"] = _measure_native(adapter, repeats)
    return rows, lora


def _measure_native(adapter: list, repeats: int) -> dict:
    """`lora_sync: native`, the learner's side: write the adapter as a PEFT directory."""
    import time

    from asyncrl.weights.lora_native import write_adapter

    seconds = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-native-") as tmp:
        for i in range(repeats + 1):  # the first warms up, not counted
            start = time.perf_counter()
            written = write_adapter(adapter, Path(tmp) / f"asyncrl-v{i}")
            seconds.append(time.perf_counter() - start)
    return {"seconds": median(seconds[1:]), "bytes": written.bytes}


def _lora_tensors(model: Any, rank: int) -> tuple[list, list]:
    """(merged full weights, adapter tensors) of `model` under a rank-`rank` peft adapter."""
    from peft import LoraConfig, get_peft_model

    from asyncrl.learner import lora

    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for name, p in peft_model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.01)
    return list(lora.merged_tensors(peft_model)), list(lora.adapter_tensors(peft_model))


async def _measure_lora(url: str, merged, adapter, repeats: int, kind: str) -> dict:
    """Per sync, the loop's way (default bucket, auto format): merged full vs adapter only."""
    from asyncrl.engine.client import EngineClient
    from asyncrl.weights.sync import WeightSender

    client, sender = EngineClient(url), WeightSender(group_name="bench_lora", timeout_s=300)
    await sender.init_group([client], backend=kind)
    fmt = "auto" if kind == "gloo" else "flattened_bucket"
    trials: dict[str, list] = {"merged": [], "adapter": []}
    try:
        version = 10_000
        for _ in range(repeats + 1):  # the first round warms up, not counted
            for label, named in (("merged", merged), ("adapter", adapter)):
                version += 1
                stats = await sender.sync(named, version, int(DEFAULT_BUCKET_MB * 2**20), fmt,
                                          pause_mode="in_place")  # fmt: skip
                trials[label].append((stats.seconds, stats.bytes))
    finally:
        await sender.close()
        await client.close()
    out = {
        k: {"seconds": median([t for t, _ in v[1:]]), "bytes": v[0][1]} for k, v in trials.items()
    }
    out["bytes_ratio"] = out["merged"]["bytes"] / out["adapter"]["bytes"]
    out["speedup"] = out["merged"]["seconds"] / out["adapter"]["seconds"]
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_raw":
        _raw_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(main())

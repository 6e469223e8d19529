"""Rollout engine throughput: generated tokens/s by batch size and response length.

The hf engine server (a separate process, driven over HTTP through the SGLang-protocol
`EngineClient` exactly as single-turn rollout actors drive it: the batch as one request in
SGLang's list form, with per-token logprobs) against transformers' own `model.generate` of the same model, batch and
length in this process (no HTTP, no logprobs): `x hf.generate` is the price of serving.
`x batch 1` is what dynamic batching buys. `x 1 req each` is the batched request against one
concurrent request per sequence (how multi-turn episodes, and single-turn groups before,
are sent), measured side by side: what one round trip per group instead of per sample buys. Every response runs to its full length
(`ignore_eos`), prompts are 32 random tokens, sampling at temperature 1.

With SGLang installed and a GPU, the same client also drives `sglang.launch_server` on the
same model (`--model` a real HF model directory gives real-model numbers there).

On the CPU the server and generate() both get `--threads` torch threads (default 1).

    asyncrl bench rollout [--smoke] [--batch-sizes 1,8,32] [--lengths 4,32,128] [--model DIR]
                          [--threads 1]
"""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

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

PROMPT_LEN = 32
MODEL = dict(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4)  # embedded size


def _prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (batch, PROMPT_LEN), generator=g).tolist()


async def engine_run(
    url: str, prompts: list[list[int]], length: int, repeats: int, batched: bool = True
) -> float:
    """Median seconds to generate `length` tokens for every prompt through the client: one
    batched request (`batched`) or one concurrent request per prompt."""
    from asyncrl.engine.client import EngineClient

    params = {"max_new_tokens": length, "temperature": 1.0, "ignore_eos": True}
    requests = [{"input_ids": p, "sampling_params": params} for p in prompts]
    times = []
    async with EngineClient(url) as client:
        for i in range(repeats + 1):  # first round: warm-up
            start = time.perf_counter()
            if batched:
                outs = await client.generate(requests)
            else:
                outs = await asyncio.gather(*(client.generate_one(r) for r in requests))
            times.append(time.perf_counter() - start)
            assert all(len(o.output_ids) == length for o in outs), "response ended early"
            del i
    return median(times[1:])


def hf_generate_run(model: Any, prompts: list[list[int]], length: int, repeats: int) -> float:
    ids = torch.tensor(prompts, device=model.device)
    kwargs = dict(max_new_tokens=length, min_new_tokens=length, do_sample=True, top_k=0,
                  temperature=1.0, attention_mask=torch.ones_like(ids), pad_token_id=0)  # fmt: skip
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            if ids.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            assert out.shape[1] == PROMPT_LEN + length
    return median(times[1:])


def measure(url: str, model: Any, batches: list[int], lengths: list[int], repeats: int,
            engine: str) -> list[dict]:  # fmt: skip
    vocab = int(model.config.vocab_size)
    rows = []
    for length in lengths:
        for batch in batches:
            prompts = _prompts(batch, vocab)
            t_engine = asyncio.run(engine_run(url, prompts, length, repeats))
            t_each = asyncio.run(engine_run(url, prompts, length, repeats, batched=False))
            t_hf = hf_generate_run(model, prompts, length, repeats)
            tokens = batch * length
            rows.append({
                "engine": engine, "batch": batch, "length": length,
                "engine_tokens_per_s": tokens / t_engine, "hf_generate_tokens_per_s": tokens / t_hf,
                "vs_hf_generate": t_hf / t_engine, "one_request_each_tokens_per_s": tokens / t_each,
                "vs_one_request_each": t_each / t_engine,
            })  # fmt: skip
        first = rows[-len(batches)]
        for row in rows[-len(batches) :]:
            row["vs_batch1"] = row["engine_tokens_per_s"] / first["engine_tokens_per_s"]
    return rows


def launch_sglang(model_dir: Path, port: int, timeout_s: float = 600) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=5):
                return proc
        except OSError:
            time.sleep(2)
    proc.kill()
    raise RuntimeError("sglang server not healthy in time")


def run_all(model_dir: Path, batches, lengths, repeats: int, threads: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from asyncrl.engine.hf.launch import launch_hf_server
    from asyncrl.net import free_port

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    extra = ["--device", device, "--num-threads", str(threads)]
    with launch_hf_server(model_dir, max_batch_size=max(batches), extra_args=extra) as h:
        rows = measure(h.url, model, batches, lengths, repeats, "hf")
    if device == "cuda" and importlib.util.find_spec("sglang") is not None:
        port = free_port()
        proc = launch_sglang(model_dir, port)
        try:
            rows += measure(f"http://127.0.0.1:{port}", model, batches, lengths, repeats, "sglang")
        finally:
            proc.terminate()
            proc.wait(60)
    return rows


def _plot(rows: list[dict]):
    def draw(fig: Any) -> None:
        ax = fig.subplots()
        for engine in sorted({r["engine"] for r in rows}):
            for length in sorted({r["length"] for r in rows}):
                sel = [r for r in rows if r["engine"] == engine and r["length"] == length]
                xs = [r["batch"] for r in sel]
                ax.plot(xs, [r["engine_tokens_per_s"] for r in sel], "o-",
                        label=f"{engine} server, {length} tokens")  # fmt: skip
                if engine == "hf":
                    ax.plot(xs, [r["hf_generate_tokens_per_s"] for r in sel], "x:",
                            label=f"hf generate(), {length} tokens")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent sequences")
        ax.set_ylabel("generated tokens / s")
        ax.legend(fontsize=8)

    return draw


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--batch-sizes", default=None)
    parser.add_argument("--lengths", default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: tiny)")
    add_threads_flag(parser)
    args = parser.parse_args(argv)
    batches = [int(v) for v in (args.batch_sizes or ("1,4" if args.smoke else "1,8,32")).split(",")]  # fmt: skip
    lengths = [int(v) for v in (args.lengths or ("8" if args.smoke else "4,32,128")).split(",")]
    repeats = args.repeats or (1 if args.smoke else 2)
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-rollout-") as tmp:
        model_dir = args.model or build_model_dir(Path(tmp) / "model", **MODEL)
        with torch_threads(args.threads):  # the in-process generate(); the server: same count
            rows = run_all(model_dir, batches, lengths, repeats, args.threads)
    print_table(
        "engine tokens/s (server over HTTP, with logprobs) vs transformers generate()",
        ["engine", "batch", "length", "server tok/s", "generate tok/s", "x generate", "x batch 1",
         "x 1 req each"],
        [[r["engine"], r["batch"], r["length"], r["engine_tokens_per_s"],
          r["hf_generate_tokens_per_s"], r["vs_hf_generate"], r["vs_batch1"],
          r["vs_one_request_each"]] for r in rows],
    )  # fmt: skip
    hf = [r for r in rows if r["engine"] == "hf"]
    best = max(hf, key=lambda r: r["engine_tokens_per_s"])
    result = {
        "model": str(args.model or f"random tiny Qwen2 {MODEL}"),
        "prompt_len": PROMPT_LEN,
        "threads": args.threads,
        "repeats": repeats,
        "rows": rows,
        "headline": {
            "hf_peak_tokens_per_s": headline(best["engine_tokens_per_s"], True, "tok/s"),
            "hf_vs_generate_at_peak": headline(best["vs_hf_generate"], True, "x"),
            "hf_batching_gain": headline(max(r["vs_batch1"] for r in hf), True, "x"),
            "hf_batched_vs_one_request_each": headline(
                max(r["vs_one_request_each"] for r in hf), True, "x"
            ),
        },
    }
    return finish("rollout", result, args, _plot(rows), argv)


if __name__ == "__main__":
    raise SystemExit(main())

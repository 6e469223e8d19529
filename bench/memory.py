"""Learner step peak memory at a real vocabulary (Qwen2.5's 151,936 tokens) on the CPU.

One torch-learner step (`TorchLearner.step`: the old-logprob pass, the training forward's
logprobs and entropy, the policy loss, backward, clip, AdamW) of one row of R response tokens, on
a Qwen2 of the real vocabulary and a small body (hidden 64, 2 layers, tied embeddings as
Qwen2.5-0.5B), each size in a fresh child process. Memory: the process's peak RSS during the
step above its RSS before it (`common.PeakMemory`: VmHWM after a /proc/self/clear_refs reset,
glibc serving every block over 128 KB by mmap so freed memory leaves RSS at once); torch's CPU
allocator has no peak counter and tracemalloc does not see it.

What the vocabulary costs: the peak above the same step's with a small vocabulary (4,096: the
body's activations and one-off allocations). That difference also holds whatever of the
embedding's gradient and AdamW moments (3 x (V - v) x H fp32, `state_diff_bytes`) is live at
the peak, so it bounds what the logprobs' LM head projection holds from above. It is compared
with one fp32 [R x V] tensor (target: <= half of one; the whole-logits path it replaced held
~4-5). That path (`--old-sizes`: the same learner with the model's own logits over every
position, as before) is measured only where 5 such tensors fit under `--old-limit-gb` (the box
is shared).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import add_threads_flag, cpu_model, finish, headline, make_parser, print_table

QWEN25_VOCAB = 151_936
PROMPT_LEN = 32


def _model_dir(path: Path, vocab: int, hidden: int, layers: int) -> Path:
    """A random Qwen2 of `vocab` tokens (tied embeddings) with the tiny character tokenizer
    (the learner reads only its pad id)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.models.tiny import build_tokenizer

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=32_768, tie_word_embeddings=True)  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def _group(resp: int, vocab: int) -> Any:
    import numpy as np

    from asyncrl.types import TrajectoryGroup

    rng = np.random.default_rng(0)
    return TrajectoryGroup(
        group_id="memory", prompt_ids=rng.integers(4, vocab, PROMPT_LEN),
        response_lengths=np.array([resp], np.int32), response_ids=rng.integers(4, vocab, resp),
        rollout_logprobs=-rng.exponential(1.0, resp).astype(np.float32),
        loss_mask=np.ones(resp, np.uint8), versions=np.zeros(resp, np.int32),
        rewards=np.ones(1, np.float32), finish_reasons=["length"], advantages=np.ones(resp, np.float32),
    )  # fmt: skip


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One step in this (fresh) process: its peak RSS growth and the state bytes it made."""
    import torch
    from _train_scale import build_learner, learner_config
    from common import PeakMemory, strict_malloc

    from asyncrl.learner import chunked
    from asyncrl.learner import logprobs as lp
    from asyncrl.threads import torch_threads

    torch.manual_seed(0)
    model_dir = _model_dir(Path(spec["dir"]), spec["vocab"], spec["hidden"], spec["layers"])
    if spec["path"] == "whole":  # the replaced path: the model's own logits, every position
        chunked.output_head = lp.output_head = lambda model: None
    cfg = learner_config(1, "fp32", ["actor.share_prompt_forward=false"])
    learner = build_learner(model_dir, cfg, "cpu")
    groups = [_group(spec["tokens"], spec["vocab"])]
    strict_malloc()
    with torch_threads(spec["threads"]), PeakMemory() as peak:
        metrics = learner.step(groups)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in learner.model.parameters())
    return {"peak_bytes": peak.bytes, "loss": metrics["actor/pg_loss"],
            "chunked": chunked.output_head(learner.model) is not None}  # fmt: skip


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"memory child {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(args: Any, tmp: Path) -> list[dict[str, Any]]:
    rows = []
    for tokens in args.sizes:
        one = 4 * tokens * args.vocab  # bytes of one fp32 [tokens x vocab] tensor
        base = {"tokens": tokens, "hidden": args.hidden, "layers": args.layers,
                "threads": args.threads}  # fmt: skip
        run = {}
        for name, vocab, path in (("small", args.small_vocab, "chunked"),
                                  ("chunked", args.vocab, "chunked"),
                                  ("whole", args.vocab, "whole")):  # fmt: skip
            if name == "whole" and (
                tokens not in args.old_sizes or 5 * one > args.old_limit_gb * 2**30
            ):
                continue
            folder = tmp / f"{name}-{tokens}"
            spec = {**base, "vocab": vocab, "path": path, "dir": str(folder)}
            out = _run_child(spec)
            if out["chunked"] != (path == "chunked"):  # the path measured is the one named
                raise RuntimeError(f"memory child {spec} ran the other logprob path")
            run[name] = out["peak_bytes"]
            print(f"  {tokens} tokens, {name}: {run[name] / 2**20:.0f} MiB", flush=True)
        state = 3 * (args.vocab - args.small_vocab) * args.hidden * 4  # grad + AdamW m, v
        row = {"tokens": tokens, "one_logits_bytes": one, "state_diff_bytes": state,
               "peak_small_vocab": run["small"], "peak_chunked": run["chunked"],
               "vocab_chunked": run["chunked"] - run["small"]}  # fmt: skip
        row["vocab_chunked_x_logits"] = row["vocab_chunked"] / one
        if "whole" in run:
            row["peak_whole"] = run["whole"]
            row["vocab_whole_x_logits"] = (run["whole"] - run["small"]) / one
        rows.append(row)
    return rows


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument(
        "--sizes", type=_sizes, default=None, help="response tokens, e.g. 2048,8192"
    )
    parser.add_argument("--old-sizes", type=_sizes, default=None, help="sizes also run whole")
    parser.add_argument("--old-limit-gb", type=float, default=10.0,
                        help="run the whole-logits path only where 5 [R x V] fp32 tensors fit")  # fmt: skip
    parser.add_argument("--vocab", type=int, default=QWEN25_VOCAB)
    parser.add_argument("--small-vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    add_threads_flag(parser)
    args = parser.parse_args(argv)
    args.sizes = args.sizes or ([256] if args.smoke else [2048, 8192, 16384])
    args.old_sizes = (
        args.old_sizes if args.old_sizes is not None else ([256] if args.smoke else [2048])
    )
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-memory-") as tmp:
        rows = measure(args, Path(tmp))
    mib = 2**20
    print_table(
        f"learner step peak RSS growth, vocabulary {args.vocab} vs {args.small_vocab}, hidden "
        f"{args.hidden}, {args.layers} layers (MiB; x = per fp32 [R x V] tensor; target <= 0.5)",
        ["R tokens", "[R x V] fp32", f"V={args.small_vocab}", "chunked", "vocab part x",
         "whole", "whole vocab part x"],
        [[r["tokens"], r["one_logits_bytes"] / mib, r["peak_small_vocab"] / mib,
          r["peak_chunked"] / mib, r["vocab_chunked_x_logits"],
          r.get("peak_whole", 0) / mib or "-", r.get("vocab_whole_x_logits", "-")] for r in rows],
    )  # fmt: skip
    worst = max(r["vocab_chunked_x_logits"] for r in rows)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent, check=False).stdout.strip()  # fmt: skip
    result = {
        "commit": commit or None,
        "cpu": cpu_model(),
        "method": "peak RSS growth over the step (VmHWM after clear_refs, strict mmap malloc), "
        "one child process per run",
        "vocab": args.vocab, "small_vocab": args.small_vocab, "hidden": args.hidden,
        "layers": args.layers, "threads": args.threads, "rows": rows, "target_x_logits": 0.5,
        "headline": {"vocab_memory_x_logits_worst": headline(worst, False, "x [R x V] fp32")},
    }  # fmt: skip
    return finish("memory", result, args, _plot(rows), argv)


def _plot(rows: list[dict]):
    def draw(fig: Any) -> None:
        ax = fig.subplots()
        x = [r["tokens"] for r in rows]
        ax.plot(x, [r["peak_chunked"] / 2**30 for r in rows], "o-", label="chunked head")
        ax.plot(x, [r["peak_small_vocab"] / 2**30 for r in rows], "s--", label="small vocabulary")
        whole = [(r["tokens"], r["peak_whole"] / 2**30) for r in rows if "peak_whole" in r]
        if whole:
            ax.plot(*zip(*whole, strict=True), "x", label="whole logits (replaced)")
        ax.set_xlabel("response tokens")
        ax.set_ylabel("step peak RSS growth (GiB)")
        ax.legend()

    return draw


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        raise SystemExit(0)
    raise SystemExit(main())

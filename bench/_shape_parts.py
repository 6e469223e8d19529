"""The parts of `asyncrl bench shape` that are not the timed rows (a helper module: no bench of
its own): the random Qwen2 model directory, the synthetic batch, the FLOP count, the attention
cost of Megatron's local (no Transformer Engine) path against flash attention, the
profiler's summary of one step, the run's clock and its plot.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: Qwen2.5-1.5B's architecture (its config.json), the bench's default shape.
QWEN25_1_5B = dict(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2,
                   vocab=151_936, rope_theta=1e6, max_positions=32_768, eps=1e-6)  # fmt: skip
#: The share of GPU time a kernel counts to, by its name (first match wins).
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "matmul", "mm")),
)


def qwen2_config(shape: dict[str, Any]) -> Any:
    """transformers' Qwen2Config of `shape` (QWEN25_1_5B's keys): tied embeddings, no sliding
    window, RoPE base and RMSNorm epsilon as Qwen2.5's."""
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
        tie_word_embeddings=True, rope_theta=shape["rope_theta"], rms_norm_eps=shape["eps"],
        max_position_embeddings=shape["max_positions"], use_sliding_window=False,
    )  # fmt: skip


def write_model_dir(path: Path, shape: dict[str, Any], device: str, dtype: torch.dtype) -> float:
    """A randomly initialised Qwen2 of `shape` written once to `path` (safetensors in `dtype`,
    the tied head stored once) with the embedded character tokenizer (the learners read only
    its pad id). The weights are made on `device` (a GPU initialises 1.5 B parameters in a
    second) and written once. Returns the seconds it took."""
    from transformers import Qwen2ForCausalLM

    from asyncrl.models.tiny import build_tokenizer

    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(qwen2_config(shape), dtype=dtype)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    del model
    return time.perf_counter() - start


def make_groups(groups: int, n: int, seq_len: int, vocab: int) -> list:
    """`groups` x `n` sequences of at most `seq_len` tokens: bench/_train_scale's prompt of
    PROMPT_LEN random tokens, responses uniform in [7/8 seq_len, seq_len] - the prompt."""
    from _train_scale import PROMPT_LEN, synthetic_groups

    hi = seq_len - PROMPT_LEN
    lo = max(1, (7 * seq_len) // 8 - PROMPT_LEN)
    if hi < 1:
        raise ValueError(f"--seq-len {seq_len}: must exceed the {PROMPT_LEN}-token prompt")
    return synthetic_groups(groups, vocab, lambda rng: rng.integers(lo, hi + 1, n), "shape")


def batch_lengths(groups: list) -> tuple[np.ndarray, np.ndarray]:
    """(real tokens, response tokens) of every sequence of `groups`."""
    real = [len(g.prompt_ids) + int(r) for g in groups for r in g.response_lengths]
    resp = [int(r) for g in groups for r in g.response_lengths]
    return np.asarray(real, np.int64), np.asarray(resp, np.int64)


def body_params(shape: dict[str, Any]) -> int:
    """Non-embedding parameters of a Qwen2 of `shape` (q/k/v with bias, o, gate/up/down, two
    RMSNorms a layer, the final norm)."""
    h, i, layers = shape["hidden"], shape["intermediate"], shape["layers"]
    kv = shape["kv_heads"] * (h // shape["heads"])
    attention = h * h + h + 2 * (h * kv + kv) + h * h
    return layers * (attention + 3 * h * i + 2 * h) + h


def step_flops(shape: dict[str, Any], real: np.ndarray, resp: np.ndarray) -> dict[str, float]:
    """Model FLOPs of one forward + backward over the batch (no activation recompute counted):
    `dense` = 6 (N_body T + V H R), N_body the non-embedding parameters, V H the LM head's
    matmul (the tied embedding matrix; only the R positions that predict a response token are
    projected), T the real (prompt + response) tokens; `attention` = sum over sequences of
    6 layers H L^2, i.e. 12 layers H L / 2 per token (QK^T and AV, causal: L / 2 keys on
    average, forward + backward). A forward-only pass (the decoupled recompute) is a third."""
    h, layers = shape["hidden"], shape["layers"]
    dense = 6.0 * (body_params(shape) * float(real.sum()) + shape["vocab"] * h * float(resp.sum()))
    attention = 6.0 * layers * h * float((real.astype(np.float64) ** 2).sum())
    return {"dense": dense, "attention": attention}


def _median_seconds(fn: Callable[[], Any], repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def attention_costs(shape: dict[str, Any], real: np.ndarray) -> dict[str, Any]:
    """Seconds per step of causal attention forward + backward over every sequence and layer
    (one GPU, bf16), two ways: as Megatron's local layer spec computes it without Transformer
    Engine (`DotProductAttention`: K/V repeated to every head, QK^T materialised, masked with
    -10000 and soft-maxed in fp32, `masked_softmax_fusion` off, then PV) and as torch's SDPA
    does (flash attention, GQA, no mask). Timed at the median sequence length, scaled by
    sum(L^2) / L_median^2: an estimate of what the fused attention that TE would bring saves."""
    heads, kv = shape["heads"], shape["kv_heads"]
    dim = shape["hidden"] // heads
    length = int(np.median(real))
    kw = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(heads, length, dim, **kw)
    k, v = torch.randn(kv, length, dim, **kw), torch.randn(kv, length, dim, **kw)
    grad = torch.randn(heads, length, dim, device="cuda", dtype=torch.bfloat16)
    causal = torch.ones(length, length, dtype=torch.bool, device="cuda").triu(1)

    def local() -> None:
        kk, vv = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        scores = torch.bmm(q, kk.transpose(1, 2)) * (1.0 / math.sqrt(dim))
        probs = torch.softmax(scores.float().masked_fill(causal, -10000.0), -1).to(q.dtype)
        torch.bmm(probs, vv).backward(grad)

    def flash() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True, enable_gqa=True
        )
        out[0].backward(grad)

    scale = float((real.astype(np.float64) ** 2).sum()) / length**2 * shape["layers"]
    out = {"median_len": length, "local_s": _median_seconds(local) * scale,
           "flash_s": _median_seconds(flash) * scale}  # fmt: skip
    out["gap_s"] = out["local_s"] - out["flash_s"]
    return out


def profile_summary(step: Callable[[], Any], cuda: bool, rows: int) -> dict[str, Any]:
    """One `step()` under torch.profiler: its top `rows` kernels (CUDA; CPU ops on the CPU) by
    self time, the GPU time by kernel class (KERNEL_CLASSES), and the share of the step's wall
    time the GPU was busy (below ~90 %: launch- or host-bound)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        spent = {e.key: e.self_device_time_total / 1e6 for e in kernels}
    else:
        spent = {e.key: e.self_cpu_time_total / 1e6 for e in events}
    calls = {e.key: e.count for e in events}
    total = sum(spent.values()) or 1.0
    top = sorted(spent.items(), key=lambda kv: -kv[1])[:rows]
    classes = {name: 0.0 for name, _ in KERNEL_CLASSES} | {"other": 0.0}
    for key, seconds in spent.items():
        name = key.lower()
        kind = next((c for c, words in KERNEL_CLASSES if any(w in name for w in words)), "other")
        classes[kind] += seconds / total
    return {"wall_s": wall, "device_s": total if cuda else None,
            "busy": total / wall if cuda else None, "classes": classes,
            "top": [{"name": k, "seconds": s, "share": s / total, "calls": calls[k]} for k, s in top]}  # fmt: skip


def profile_lines(summary: dict[str, Any]) -> tuple[str, list[list[Any]]]:
    """The profile's title and table rows for `common.print_table`."""
    classes = ", ".join(f"{k} {100 * v:.0f} %" for k, v in summary["classes"].items())
    busy = summary["busy"]
    where = f"GPU busy {100 * busy:.0f} % of the step's wall time; " if busy is not None else ""
    title = (
        f"profile of one learner step ({summary['wall_s']:.3g} s): {where}time by class: {classes}"
    )
    rows = [
        [t["name"][:90], 1e3 * t["seconds"], 100 * t["share"], t["calls"]] for t in summary["top"]
    ]
    return title, rows


NO_TE = (
    "Megatron without Transformer Engine runs its local layer spec: unfused attention (QK^T "
    "materialised per head, an fp32 softmax, PV; no flash or cuDNN attention), torch's RMSNorm "
    "(no fused layernorm), unfused RoPE, a vocab-parallel cross entropy of plain torch ops (no "
    "fused cross entropy), no gradient-accumulation fusion (apex); its row is a lower bound of "
    "Megatron with TE."
)


class Clock:
    """Seconds since the bench began, against its time budget."""

    def __init__(self, budget: float) -> None:
        self.start, self.budget = time.perf_counter(), budget

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget - self.elapsed()


def plot(rows: list[dict[str, Any]], target_mfu: float) -> Callable[[Any], None]:
    """The rows' MFU (GPU) or model GFLOP/s (CPU) as bars, for `common.finish`."""

    def draw(fig: Any) -> None:
        ax = fig.subplots()
        done = [r for r in rows if r.get("seconds")]
        labels = [f"{r['path']} @{r['budget']}" for r in done]
        if done and done[0].get("mfu") is not None:
            ax.barh(labels, [100 * (r.get("mfu") or 0) for r in done])
            ax.axvline(100 * target_mfu, color="k", linestyle="--", label="target")
            ax.set_xlabel("MFU % (with attention)")
            ax.legend()
        else:
            ax.barh(labels, [r["tflops"] * 1e3 for r in done])
            ax.set_xlabel("model GFLOP/s")
        ax.set_title("learner step at the real shape")

    return draw

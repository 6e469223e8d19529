"""The scale parts of `asyncrl bench train` (a helper module: no bench of its own).

(a) packed vs padded on a ragged, long-tailed length distribution: real trained tokens/s of
    the learner with `use_dynamic_bsz` vs fixed micro-batches of padded rows, and the fraction
    of the padded batch that is padding;
(b) FSDP2 on 2 CPU ranks vs 1 process: this rank's parameter + gradient + optimizer bytes
    (rank 0, the larger share of an uneven split) and the step time;
(c) the packed learner step vs a bare packed fwd+bwd of the same real tokens (no IS, no
    metrics: forward, masked policy-gradient loss, backward, clip, AdamW);
(d) attention on one packed row of `--row-tokens` (default 8k) real tokens: the learner's
    varlen attention (`asyncrl.learner.varlen`, each sequence its own causal attention) vs the
    dense block-diagonal mask transformers' sdpa builds from the position ids, one fwd+bwd of
    the same model and tokens each (target: varlen faster).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.learner import packing

PROMPT_LEN = 32


def ragged_groups(groups: int, n: int, resp_len: int, vocab: int, seed: int = 0) -> list:
    """Response lengths log-normal (median resp_len / 4, sigma 1: a long tail, as RL responses
    have), clipped to [4, 4 · resp_len]."""

    def lengths(rng: np.random.Generator) -> np.ndarray:
        return np.clip(rng.lognormal(np.log(max(4, resp_len // 4)), 1.0, n), 4, 4 * resp_len)

    return synthetic_groups(groups, vocab, lengths, "ragged", seed)


def synthetic_groups(
    groups: int,
    vocab: int,
    draw_lengths: Callable[[np.random.Generator], np.ndarray],
    name: str,
    seed: int = 0,
) -> list:
    """Groups of random tokens (prompts of PROMPT_LEN), response lengths from `draw_lengths`."""
    from asyncrl.types import TrajectoryGroup

    rng = np.random.default_rng(seed)
    out = []
    for gi in range(groups):
        lengths = draw_lengths(rng).astype(np.int32)
        n = len(lengths)
        total = int(lengths.sum())
        adv = rng.standard_normal(n).astype(np.float32)
        out.append(TrajectoryGroup(
            group_id=f"{name}-{gi}", prompt_ids=rng.integers(4, vocab, PROMPT_LEN),
            response_lengths=lengths, response_ids=rng.integers(4, vocab, total),
            rollout_logprobs=-rng.exponential(1.0, total).astype(np.float32),
            loss_mask=np.ones(total, np.uint8), versions=np.zeros(total, np.int32),
            rewards=rng.random(n).astype(np.float32), finish_reasons=["length"] * n,
            advantages=np.repeat(adv, lengths),
        ))  # fmt: skip
    return out


def learner_config(micro: int, dtype: str, extra: list[str]) -> Any:
    from asyncrl.config import load_config

    return load_config(None, [
        f"actor_train.model_args.dtype={dtype}",
        f"actor_train.training_args.per_device_train_batch_size={micro}",
        f"actor_train.infer_batch_size={micro}", "actor_train.training_args.learning_rate=1e-5",
        "actor_train.model_args.disable_gradient_checkpointing=true", *extra,
    ])  # fmt: skip


def build_learner(model_dir: Path, cfg: Any, device: str, world: int = 1) -> Any:
    from asyncrl.device import device_spec
    from asyncrl.learner.torch.distributed import DistributedTorchLearner
    from asyncrl.learner.torch.learner import TorchLearner

    kwargs = dict(model_path=model_dir, train=cfg.actor_train, actor=cfg.actor,
                  algorithm=cfg.algorithm, temperature=1.0, total_steps=1000)  # fmt: skip
    if world > 1:  # ranks on `device`'s kind (gloo on the CPU), also on a GPU machine
        return DistributedTorchLearner(world, device=device_spec(device.split(":")[0]), **kwargs)
    return TorchLearner(**kwargs, device=device)


def bare_packed_step(model: Any, opt: Any, data: dict[str, torch.Tensor], budget: int) -> None:
    """Forward, masked PG loss (token mean), backward per packed micro-batch; clip; AdamW."""
    model.train()
    opt.zero_grad(set_to_none=True)
    mask = data["response_mask"]
    total = mask.sum()
    for part in packing.partition(packing.real_lengths(data["attention_mask"]), budget):
        idx = torch.tensor(part, dtype=torch.long)
        rows = {k: v[idx] for k, v in data.items()}
        packed = packing.pack(rows, one_row=packing.one_row(model))
        out = packing.forward(model, packed, logits_to_keep=packed.keep).logits
        logits = out.reshape(-1, out.shape[-1])[packed.select].float()
        logp = logits.gather(-1, packed.targets[:, None]).squeeze(-1) - logits.logsumexp(-1)
        adv = rows["advantages"][packed.rows, packed.cols]
        (-(logp * adv).sum() / total).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def measure_packing(model_dir: Path, groups: list, micro: int, budget: int, repeats: int) -> dict:
    """(a) and (c): padded learner, packed learner, bare packed fwd+bwd, on the same batch."""
    from asyncrl.learner.collate import collate

    data = collate(groups, 0).to_torch("cpu")
    data["response_mask"] = data["response_mask"].float()
    lengths = packing.real_lengths(data["attention_mask"])
    real = float(data["response_mask"].sum())
    seconds = {}
    for name, extra in (("padded", []), ("packed", ["actor.use_dynamic_bsz=true",
                                                    f"actor.ppo_max_token_len_per_gpu={budget}"])):  # fmt: skip
        learner = build_learner(model_dir, learner_config(micro, "fp32", extra), "cpu")
        seconds[name] = timed(lambda lr=learner: lr.step(groups), repeats)
    model = learner.model  # the packed learner's
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    seconds["bare_packed"] = timed(lambda: bare_packed_step(model, opt, data, budget), repeats)
    return {
        "seconds": seconds,
        "real_tokens": real,
        "tokens_per_s": {k: real / v for k, v in seconds.items()},
        "pad_fraction": packing.pad_fraction(lengths, width=int(data["input_ids"].shape[1])),
        "rows": len(lengths),
        "max_len": max(lengths),
        "median_len": float(np.median(lengths)),
    }


def state_bytes(learner: Any) -> int:
    """This rank's parameter + gradient + optimizer-state bytes (a DTensor: its local shard)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = 0
    for p in learner.model.parameters():
        total += local(p) + (local(p.grad) if p.grad is not None else 0)
    for state in learner.optimizer.state.values():
        total += sum(local(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
    return total


def measure_fsdp(model_dir: Path, groups: list, micro: int, repeats: int) -> dict:
    """(b): 1 process vs 2 FSDP2 ranks (rank 1 a Ray actor) on the same batch."""
    out: dict[str, Any] = {}
    cfg = learner_config(micro, "fp32", [])
    for world in (1, 2):
        learner = build_learner(model_dir, cfg, "cpu", world)
        try:
            seconds = timed(lambda lr=learner: lr.step(groups), repeats)
            local = learner.local if world > 1 else learner
            out[world] = {"seconds": seconds, "state_bytes": state_bytes(local)}
        finally:
            learner.close()
    out["state_ratio"] = out[2]["state_bytes"] / out[1]["state_bytes"]
    out["step_ratio"] = out[1]["seconds"] / out[2]["seconds"]
    return out


def measure_varlen(model_dir: Path, row_tokens: int, repeats: int, seed: int = 0) -> dict:
    """(d): one packed row of about `row_tokens` real tokens (log-normal sequence lengths, the
    ragged shape), fwd + summed-logprob bwd, varlen attention vs sdpa's dense block mask."""
    from transformers import AutoModelForCausalLM

    from asyncrl.learner import varlen

    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < row_tokens:
        lengths.append(int(np.clip(rng.lognormal(np.log(256), 1.0), 16, row_tokens // 2)))
    lengths[-1] -= sum(lengths) - row_tokens  # exactly row_tokens
    ids = torch.from_numpy(rng.integers(4, 100, row_tokens))[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    bounds = packing.boundary_kwargs(cu, max(lengths))
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    assert varlen.enable(model), varlen.why_not(model)

    def step(impl: str) -> None:
        model.config._attn_implementation = impl
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, **bounds).logits
        logits.float().log_softmax(-1).amax(-1).sum().backward()

    seconds = {name: timed(lambda i=impl: step(i), repeats)
               for name, impl in (("varlen", varlen.NAME), ("dense_mask", "sdpa"))}  # fmt: skip
    return {"seconds": seconds, "row_tokens": row_tokens, "sequences": len(lengths),
            "max_len": max(lengths), "speedup": seconds["dense_mask"] / seconds["varlen"]}  # fmt: skip

"""The Megatron learner's chunked output layer (asyncrl/learner/megatron/head.py) against the
full-logits path (GPTModel's output layer over every position, Megatron's
vocab_parallel_cross_entropy, `logits.token_logprobs`) inside a running emulated rank
(tests/megatron_emulation.py): the same micro-batches through Megatron's schedule both ways, a
loss that weighs every response token's logprob and entropy, and the largest differences of the
logprobs, the entropies and every parameter's gradient (after Megatron's gradient
finalisation), at a temperature > 0 and = 0.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

#: tokens per chunk in the emulation: the tiny batches span several chunks
CHUNK_TOKENS = 5


def small_chunks(worker) -> None:
    """`head.chunk_bytes` for `CHUNK_TOKENS` tokens of this rank's vocabulary shard."""
    from megatron.core import parallel_state as ps

    from asyncrl.learner.megatron import head

    rows = worker.shape.vocab_rows // ps.get_tensor_model_parallel_world_size()
    head.chunk_bytes = CHUNK_TOKENS * 4 * rows


@contextlib.contextmanager
def full_logits(chunks: list) -> Iterator[None]:
    """The model's own output layer (every position's logits) while inside."""
    from asyncrl.learner.megatron.weights import unwrap

    layers = [unwrap(c).output_layer for c in chunks if unwrap(c).post_process]
    saved = [{k: layer.__dict__.pop(k) for k in ("forward", "passes_hidden")} for layer in layers]
    try:
        yield
    finally:
        for layer, attrs in zip(layers, saved, strict=True):
            layer.__dict__.update(attrs)


def _pass(worker, data: dict, micro: list, weights: torch.Tensor) -> tuple:
    """(logprobs, entropies) of the live micro-batches (last stage; else None) and every
    parameter's finalised gradient after one forward and backward of sum(weights * (lp + ent))."""
    scores = []

    def loss_of(item, weight, output):
        idx = item[0]
        lp, ent = worker._token_logprobs(output, weight, data, idx, entropy=True)
        scores.append((lp.detach().clone(), ent.detach().clone()))
        w = weights[idx]  # a dead micro-batch weighs nothing
        return (w[:, 0] * lp + w[:, 1] * ent).sum() * float(item[1]), {}

    for chunk in worker.chunks:
        chunk.zero_grad_buffer()
        chunk.train()
    worker._run(worker.chunks, data, micro, loss_of, forward_only=False)
    grads = {f"{i}.{name}": p.main_grad.detach().clone()
             for i, chunk in enumerate(worker.chunks)
             for name, p in chunk.named_parameters() if p.requires_grad}  # fmt: skip
    live = [s for s, (_, alive) in zip(scores, micro, strict=True) if alive] if scores else []
    return live, grads


def compare(worker, batch: list) -> dict[str, dict[str, float]]:
    """{temperature: {logprob, entropy, grad (max abs diff), grad_scale (max abs gradient)}}
    of this rank (logprob/entropy NaN off the last stage)."""
    from asyncrl.learner.megatron.batch import shard_rows
    from asyncrl.learner.megatron.data_parallel import dp_ranks

    data = worker._data(batch)
    rows = data["tokens"].shape[0]
    dev = data["tokens"].device
    dp, dp_rank, last = dp_ranks()
    mine = shard_rows(rows, dp, dp_rank).to(dev)
    size = worker.train.training_args.per_device_train_batch_size
    micro = worker._micro(mine, size, mine[:1])
    gen = torch.Generator().manual_seed(7)
    # [rows, 2, R]: each response token's logprob and entropy weighed at random
    weights = torch.randn(rows, 2, data["resp_index"].shape[1], generator=gen).to(dev)
    out = {}
    kept = worker.temperature
    for temperature in (0.7, 0.0):
        worker.temperature = temperature
        got_scores, got = _pass(worker, data, micro, weights)
        with full_logits(worker.chunks):
            want_scores, want = _pass(worker, data, micro, weights)
        diff = {"logprob": float("nan"), "entropy": float("nan")}
        if last:
            diff["logprob"] = max((g[0] - w[0]).abs().max().item()
                                  for g, w in zip(got_scores, want_scores, strict=True))  # fmt: skip
            diff["entropy"] = max((g[1] - w[1]).abs().max().item()
                                  for g, w in zip(got_scores, want_scores, strict=True))  # fmt: skip
        diff["grad"] = max((got[n] - want[n]).abs().max().item() for n in want)
        diff["grad_scale"] = max(t.abs().max().item() for t in want.values())
        out[str(temperature)] = diff
    worker.temperature = kept
    for chunk in worker.chunks:
        chunk.zero_grad_buffer()
    return out


def worst(per_rank: list[dict]) -> dict[str, dict[str, float]]:
    """`compare`'s results of every rank -> the largest of each figure (NaN ones skipped)."""
    return {t: {k: max((r[t][k] for r in per_rank if not math.isnan(r[t][k])), default=math.nan)
                for k in per_rank[0][t]} for t in per_rank[0]}  # fmt: skip


#: TransformerConfig settings under which the model's logits are more than its output layer's
#: projection (or its weight gradient is not autograd's): the full-logits path stays.
FALLBACKS = {"mtp_num_layers": 1, "use_mup": True, "defer_embedding_wgrad_compute": True}


def fallbacks(worker) -> dict[str, str | None]:
    """`head.unsupported`'s reason for the last stage's real model with each `FALLBACKS`
    setting in turn (the config restored after each); "as built": the model as it is."""
    from asyncrl.learner.megatron.head import unsupported
    from asyncrl.learner.megatron.weights import unwrap

    model = unwrap(worker.chunks[-1])
    if not model.post_process:
        return {}
    reasons = {"as built": unsupported(model)}
    for key, value in FALLBACKS.items():
        kept = getattr(model.config, key, None)
        setattr(model.config, key, value)
        try:
            reasons[key] = unsupported(model)
        finally:
            setattr(model.config, key, kept)
    return reasons

"""Per-token logprobs and entropy from one rank's Megatron logits (vocab-parallel over TP, and
this CP rank's positions only under context parallelism: those are gathered back to whole
sequences before the response tokens are picked, so the loss sees exactly what it sees without
CP). Megatron is imported inside the functions only.

The full-logits path: every position's [B, S', V/TP] logits. The learner takes it only for a
model whose output layer `head.pass_hidden` cannot take over (`head.unsupported` says why, in
one log line); every other model is scored by `head.response_logprobs`, at the response
positions only, a chunk of tokens at a time. The tests compare the two.
"""

from __future__ import annotations

import torch

from asyncrl.learner.megatron.batch import entropy_from_partials, entropy_partials, gather_response


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, resp_index: torch.Tensor,
                   temperature: float, vocab_size: int, entropy: bool):  # fmt: skip
    """([B, R] logprobs, [B, R] entropy or None) of the response tokens; `logits` [B, S', V/TP]
    and `labels` [B, S'] at this rank's positions, `resp_index` [B, R] over whole sequences."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    scaled = logits.float().div(temperature) if temperature > 0 else logits.float().clone()
    scaled = mask_padded_vocab(scaled, vocab_size)
    ent = vocab_parallel_entropy(scaled) if entropy else None
    # vocab_parallel_cross_entropy shifts its input in place: give it its own copy
    ce_in = scaled.clone() if ent is not None else scaled
    per_pos = -tensor_parallel.vocab_parallel_cross_entropy(ce_in, labels)
    if ps.get_context_parallel_world_size() > 1:
        from asyncrl.learner.megatron.context import gather_positions

        per_pos = gather_positions(per_pos)
        ent = gather_positions(ent) if ent is not None else None
    lp = gather_response(per_pos, resp_index)
    return lp, (gather_response(ent, resp_index) if ent is not None else None)


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Vocabulary rows added to reach a multiple of TP are not tokens: exclude them from the
    softmax (a finite minimum, so entropy's 0 * logit stays 0)."""
    from megatron.core import parallel_state as ps

    width = logits.shape[-1]
    first = ps.get_tensor_model_parallel_rank() * width
    if first + width <= vocab_size:
        return logits
    pad = torch.arange(first, first + width, device=logits.device) >= vocab_size
    return logits.masked_fill(pad, torch.finfo(logits.dtype).min)


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy per position over the TP-sharded vocabulary (see `batch.entropy_partials`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    m = logits.detach().max(-1).values
    torch.distributed.all_reduce(
        m, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group()
    )
    s, w = entropy_partials(logits, m)
    s, w = (
        reduce_from_tensor_model_parallel_region(s),
        reduce_from_tensor_model_parallel_region(w),
    )
    return entropy_from_partials(m, s, w)

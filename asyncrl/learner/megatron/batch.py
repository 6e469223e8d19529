"""The Megatron learner's batch layout and vocab-parallel math, in plain torch (CPU-tested).

`collate` gives `[left-padded prompt | right-padded response]` rows and relies on an attention
mask. Megatron's attention (local `DotProductAttention` and Transformer Engine alike) is
causal and ignores padding masks, so each row is shifted left instead: `[prompt | response |
pads]`. Under a causal mask trailing pads cannot affect real tokens, positions are simply
0..S-1, and no mask is needed. Response token j of row i is then predicted by the logits at
position `prompt_len_i - 1 + j`. The sequence is padded to a multiple of the TP size (sequence
parallelism splits it).

Entropy over vocab-parallel logits: every TP rank holds a slice of the vocabulary; with the
global max m, S = sum exp(l - m) and W = sum exp(l - m) * l reduced over ranks, the entropy is
m + log S - W / S. `entropy_partials` computes one rank's (S, W); the worker all-reduces them.

Context parallelism splits every row along the sequence the way Megatron does
(`megatron.core.utils.get_batch_on_this_cp_rank`): the sequence is cut into 2·CP chunks and CP
rank r holds chunks r and 2·CP-1-r, so every rank gets the same share of causal-attention work.
`cp_positions` names those positions; the worker gathers per-position values back with them.
"""

from __future__ import annotations

import torch


def right_align(data: dict[str, torch.Tensor], pad_id: int, multiple: int = 1) -> dict:
    """tokens [B, S'], position_ids [B, S'], labels [B, S'] and resp_index [B, R]."""
    ids, mask = data["input_ids"], data["attention_mask"].bool()
    rows, width = ids.shape
    resp_len = data["response_mask"].shape[1]
    prompt_width = width - resp_len
    prompt_lens = mask[:, :prompt_width].sum(dim=1)
    seq = -(-width // multiple) * multiple
    tokens = torch.full((rows, seq), pad_id, dtype=ids.dtype, device=ids.device)
    # Row i drops its (prompt_width - p_i) left pads: column c of the input lands at c - shift.
    shift = prompt_width - prompt_lens
    cols = torch.arange(width, device=ids.device).expand(rows, width)
    keep = cols >= shift[:, None]
    tokens[keep.nonzero(as_tuple=True)[0], (cols - shift[:, None])[keep]] = ids[keep]
    labels = torch.full_like(tokens, pad_id)
    labels[:, :-1] = tokens[:, 1:]
    j = torch.arange(resp_len, device=ids.device)
    resp_index = (prompt_lens[:, None] - 1 + j).clamp(max=seq - 1)
    positions = torch.arange(seq, device=ids.device).expand(rows, seq).contiguous()
    return {"tokens": tokens, "position_ids": positions, "labels": labels, "resp_index": resp_index}


def gather_response(per_position: torch.Tensor, resp_index: torch.Tensor) -> torch.Tensor:
    """[B, S] values at every position -> [B, R] values predicting the response tokens."""
    return torch.gather(per_position, 1, resp_index)


def entropy_partials(
    local_logits: torch.Tensor, global_max: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One vocab shard's (sum exp(l - m), sum exp(l - m) * l) along the last dim."""
    shifted = torch.exp(local_logits - global_max.unsqueeze(-1))
    return shifted.sum(-1), (shifted * local_logits).sum(-1)


def entropy_from_partials(
    global_max: torch.Tensor, sum_exp: torch.Tensor, sum_exp_logit: torch.Tensor
) -> torch.Tensor:
    return global_max + torch.log(sum_exp) - sum_exp_logit / sum_exp


def shard_rows(rows: int, parts: int, index: int) -> torch.Tensor:
    """Contiguous, balanced share `index` of `parts` over `rows` rows (data parallelism)."""
    base, extra = divmod(rows, parts)
    start = index * base + min(index, extra)
    return torch.arange(start, start + base + (1 if index < extra else 0))


def micro_batches(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def cp_positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """The sequence positions CP rank `rank` holds: chunks `rank` and `2·cp-1-rank` of `2·cp`
    equal chunks (Megatron's load-balanced split; `seq` must be a multiple of 2·cp)."""
    if seq % (2 * cp):
        raise ValueError(f"sequence length {seq} is not a multiple of 2 x CP ({2 * cp})")
    chunk = seq // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def cp_order(seq: int, cp: int) -> torch.Tensor:
    """Positions of the CP ranks' local sequences concatenated in rank order (what an
    all-gather over the CP group yields)."""
    return torch.cat([cp_positions(seq, cp, r) for r in range(cp)])


def schedule_micro(
    rows: torch.Tensor, size: int, filler: torch.Tensor, multiple: int = 1
) -> list[tuple[torch.Tensor, bool]]:
    """(row indices, live) micro-batches of at most `size` rows, their number a positive
    multiple of `multiple` (Megatron's interleaved schedule needs a multiple of the pipeline
    size). Where there are too few rows, dead micro-batches run the one row `filler` and weigh
    nothing, so every rank of a pipeline still runs the same schedule."""
    needed = -(-len(rows) // size)
    count = -(-max(1, needed) // multiple) * multiple
    if count == needed:
        parts = micro_batches(rows, size)
    else:  # more, smaller micro-batches (each still at most `size` rows)
        parts = list(torch.tensor_split(rows, min(count, len(rows)))) if len(rows) else []
    return [(p, True) for p in parts] + [(filler, False)] * (count - len(parts))

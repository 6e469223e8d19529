"""Sequence packing under a token budget (verl's `use_dynamic_bsz` + `ppo_max_token_len_per_gpu`).

Three pure steps, none of which knows about the loss:

1. `partition`: split a rank's rows (by real length: prompt + response tokens, no padding) into
   micro-batches of at most `budget` tokens each (a row longer than the budget alone), balanced
   by greedy longest-first assignment to the least-loaded micro-batch. With W > 1
   data-parallel ranks (`micro_batches`) every rank gets the SAME number of micro-batches (the
   maximum over the default process group, empty ones allowed): under FSDP2 every forward and
   backward is a collective, so a rank with fewer would hang the others.
2. `pack`: the micro-batch's real tokens concatenated into one row, `position_ids` restarting
   at 0 for every sequence and no attention mask. transformers (≥ 4.53, checked on 5.23) reads
   sequence boundaries from such position ids: `masking_utils.find_packed_sequence_indices`
   builds a block-diagonal causal mask for sdpa/eager/flex, and flash_attention_2 takes the
   varlen path with cu_seqlens derived from them. So each token sees exactly the keys and the
   position it saw in its padded row.
3. `unpack`: values computed at the packed positions that predict response tokens go back into
   the padded [rows, response_len] layout (0.0 where a row has no token), so the objective, IS
   weights and masks downstream are unchanged.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _fits(load: int, count: int, budget: int) -> bool:
    # A micro-batch is within budget, or holds one row that alone exceeds it.
    return load <= budget or count <= 1


def balanced(lengths: Sequence[int], budget: int, parts: int) -> list[list[int]] | None:
    """Rows (indices into `lengths`) in exactly `parts` micro-batches, longest row first into
    the least-loaded one (so max load - min load ≤ the longest row); None when a micro-batch
    would exceed `budget` with more than one row. Rows keep ascending order within a part."""
    if parts < 1:
        return None if lengths else []
    bins: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, i) for i in range(parts)]  # (load, bin); ties go to the lower bin: deterministic
    order = sorted(range(len(lengths)), key=lambda r: (-lengths[r], r))
    for row in order:
        load, b = heapq.heappop(heap)
        bins[b].append(row)
        load += int(lengths[row])
        if not _fits(load, len(bins[b]), budget):
            return None
        heapq.heappush(heap, (load, b))
    return [sorted(b) for b in bins]


def partition(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """The fewest balanced micro-batches (as `balanced`) that respect `budget`: starts at the
    lower bound (rows over the budget + ceil(rest / budget)) and adds one until it fits; with
    one row per micro-batch it always does. No rows: no micro-batches."""
    if budget <= 0:
        raise ValueError(f"packing token budget must be > 0, got {budget}")
    over = sum(1 for n in lengths if n > budget)
    rest = sum(int(n) for n in lengths if n <= budget)
    parts = over + math.ceil(rest / budget)
    while True:
        found = balanced(lengths, budget, parts)
        if found is not None:
            return found
        parts += 1


def global_max(count: int, across_ranks: bool = True) -> int:
    """`count`'s maximum over the default process group (itself without one, with W = 1, or
    when not `across_ranks`: a model that is not sharded runs no collective, so a one-process
    learner in a process that also holds a group must not join that group's reductions)."""
    dist = torch.distributed
    if not across_ranks:
        return count
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return count
    # gloo reduces CPU tensors; nccl/hccl only tensors on their accelerator (cuda/npu).
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device = "cpu" if dist.get_backend() == "gloo" or accel is None else accel
    value = torch.tensor([count], dtype=torch.long, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def micro_batches(
    lengths: Sequence[int], budget: int, across_ranks: bool = True
) -> list[list[int]]:
    """`partition` with the same number of micro-batches on every data-parallel rank: the
    maximum over ranks, re-balanced into that many (or padded with empty micro-batches when a
    re-balance would break the budget). A collective when a process group is initialised."""
    own = partition(lengths, budget)
    count = global_max(len(own), across_ranks)
    if count == len(own):
        return own
    return balanced(lengths, budget, count) or own + [[] for _ in range(count - len(own))]


def pad_fraction(lengths: Sequence[int], width: int | None = None) -> float:
    """The share of a padded [rows, width] batch that is padding (width: the longest row):
    what the padded path computes for nothing and packing saves."""
    if not len(lengths):
        return 0.0
    width = max(lengths) if width is None else width
    total = width * len(lengths)
    return 1.0 - sum(int(n) for n in lengths) / total if total else 0.0


@dataclass(frozen=True)
class Packed:
    """One micro-batch as a single packed row plus the map back to the padded layout."""

    input_ids: torch.Tensor
    """[1, T] the rows' real tokens, concatenated in row order."""
    position_ids: torch.Tensor
    """[1, T] 0..L-1 within each sequence (the positions each token has in its padded row)."""
    logit_index: torch.Tensor
    """[N] packed position whose logit predicts each real response token."""
    targets: torch.Tensor
    """[N] the response token ids those logits score."""
    rows: torch.Tensor
    """[N] the padded row of each response token."""
    cols: torch.Tensor
    """[N] its response column (0 = first response token)."""
    shape: tuple[int, int]
    """(rows, response_len) of the padded layout `unpack` writes into."""


def real_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Real tokens (prompt + response, no padding) of every padded row."""
    return [int(n) for n in attention_mask.sum(dim=-1).tolist()]


def pack(tensors: dict[str, torch.Tensor]) -> Packed:
    """`tensors` (the collated layout: left-padded prompt | right-padded response, see
    `asyncrl.types.collate`) as one packed row. A response token's logit sits one packed
    position before the token, inside its own sequence (its prompt is never empty)."""
    attn = tensors["attention_mask"].bool()
    rows, resp_len = tensors["response_mask"].shape
    prompt_len = attn.shape[1] - resp_len
    ids = tensors["input_ids"][attn]
    # Positions as collate makes them (cumsum - 1 over the real tokens): 0..L-1 per sequence.
    positions = (attn.long().cumsum(dim=-1) - 1)[attn]
    flat = torch.full(attn.shape, -1, dtype=torch.long, device=attn.device)
    flat[attn] = torch.arange(ids.numel(), device=attn.device)
    resp = attn[:, prompt_len:]
    r, c = resp.nonzero(as_tuple=True)
    index = flat[:, prompt_len:][r, c] - 1
    return Packed(
        input_ids=ids[None],
        position_ids=positions[None],
        logit_index=index,
        targets=ids[index + 1],
        rows=r,
        cols=c,
        shape=(rows, resp_len),
    )


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Per-response-token `values` ([N, ...]) in the padded [rows, response_len, ...] layout,
    0.0 where a row has no real token; differentiable in `values`."""
    out = values.new_zeros((*packed.shape, *values.shape[1:]))
    return out.index_put((packed.rows, packed.cols), values)


def packed_hidden_states(trunk: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, R, H] last hidden states at the positions that predict each response token (what a
    value head reads, `asyncrl.learner.critic`), from one packed forward of a transformer trunk
    (`AutoModel`: `last_hidden_state` out); 0.0 where a row has no real token."""
    packed = pack(tensors)
    out = trunk(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=None,  # boundaries come from position_ids (module docstring)
        use_cache=False,
    )
    return unpack(out.last_hidden_state[0, packed.logit_index], packed)

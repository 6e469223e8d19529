"""Sequence packing under a token budget (verl's `use_dynamic_bsz` + `ppo_max_token_len_per_gpu`).

Three pure steps, none of which knows about the loss:

1. `partition`: split a rank's rows (by real length: prompt + response tokens, no padding) into
   micro-batches of at most `budget` tokens each (a row longer than the budget alone), balanced
   by greedy longest-first assignment to the least-loaded micro-batch. With W > 1
   data-parallel ranks (`micro_batches`) every rank gets the SAME number of micro-batches (the
   maximum over the default process group, empty ones allowed): under FSDP2 every forward and
   backward is a collective, so a rank with fewer would hang the others.
2. `pack`: the micro-batch's real tokens concatenated into one row, `position_ids` restarting
   at 0 for every sequence, no attention mask, and the sequences' boundaries as cumulative
   lengths (`Packed.attention_kwargs`) for a varlen attention: `asyncrl.learner.varlen` (taken
   by sdpa models, `forward`), or flash-attention's own varlen kernel. Eager and flex attention
   would read the boundaries from the
   position ids as a dense block-diagonal mask (transformers ≥ 4.53,
   `masking_utils.find_packed_sequence_indices`): one row of T tokens would cost T², so for it
   sequences go into rows as long as the longest sequence (`fill_rows`) instead. Either way
   each token sees exactly the keys and the position it saw in its padded row.
3. `unpack`: values computed at the packed positions that predict response tokens go back into
   the padded [rows, response_len] layout (0.0 where a row has no token), so the objective, IS
   weights and masks downstream are unchanged.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncrl.learner import varlen


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
    """One micro-batch packed into rows (`pack`) plus the map back to the padded layout."""

    input_ids: torch.Tensor
    """[B, W] the sequences' real tokens, each whole inside one row; a row's tail is padding."""
    position_ids: torch.Tensor
    """[B, W] 0..L-1 within each sequence (the positions each token has in its padded row);
    a row's padding tail counts 0, 1, ... again: a segment of its own that no token sees."""
    logit_index: torch.Tensor
    """[N] flat position (row * W + column) whose output predicts each real response token."""
    keep: torch.Tensor
    """[K] the columns holding any of those positions (a forward's `logits_to_keep`)."""
    select: torch.Tensor
    """[N] each response token's place in the [B, K] outputs at `keep`, flattened."""
    targets: torch.Tensor
    """[N] the response token ids those logits score."""
    rows: torch.Tensor
    """[N] the padded row of each response token."""
    cols: torch.Tensor
    """[N] its response column (0 = first response token)."""
    shape: tuple[int, int]
    """(rows, response_len) of the padded layout `unpack` writes into."""
    cu_seq_lens: torch.Tensor | None = None
    """[S + 1] int32 cumulative sequence lengths of a one-row pack (None for rows)."""
    max_len: int = 0
    """The longest sequence's length."""

    def attention_kwargs(self) -> dict[str, object]:
        """The forward's kwargs that tell a varlen attention the boundaries (transformers'
        flash-attention kwarg names; none for packs in several rows)."""
        if self.cu_seq_lens is None:
            return {}
        return boundary_kwargs(self.cu_seq_lens, self.max_len)


def boundary_kwargs(cu_seq_lens: torch.Tensor, max_len: int) -> dict[str, object]:
    """A packed row's sequence boundaries as a forward's kwargs (transformers' flash-attention
    names, which `asyncrl.learner.varlen` reads too)."""
    cu, n = cu_seq_lens, max_len
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": n, "max_length_k": n}


def real_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Real tokens (prompt + response, no padding) of every padded row."""
    return [int(n) for n in attention_mask.sum(dim=-1).tolist()]


def fill_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sequences (indices into `lengths`) laid into rows of at most `capacity` tokens (one
    longer sequence alone), first-fit by decreasing length; rows in order of their first
    sequence, sequences in index order within a row."""
    rows: list[list[int]] = []
    loads: list[int] = []
    for seq in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        n = int(lengths[seq])
        spot = next((i for i, load in enumerate(loads) if load + n <= capacity), None)
        if spot is None:
            rows.append([seq])
            loads.append(n)
        else:
            rows[spot].append(seq)
            loads[spot] += n
    return sorted((sorted(r) for r in rows), key=lambda r: r[0])


def pack(tensors: dict[str, torch.Tensor], one_row: bool = True) -> Packed:
    """`tensors` (the collated layout: left-padded prompt | right-padded response, see
    `asyncrl.learner.collate.collate`) packed. `one_row`: every sequence in one row, for an attention
    that reads the boundaries at no cost (flash-attention's varlen kernel). Else rows of the
    longest sequence's length (`fill_rows`): a dense block-diagonal mask (sdpa, eager) then
    costs rows x longest², never more than the padded batch's attention, where one row of T
    tokens would cost T². A response token's logit sits one position before the token, inside
    its own sequence (its prompt is never empty)."""
    attn = tensors["attention_mask"].bool()
    n_rows, resp_len = tensors["response_mask"].shape
    prompt_len = attn.shape[1] - resp_len
    lengths = real_lengths(attn)
    layout = [list(range(n_rows))] if one_row else fill_rows(lengths, max(lengths, default=1))
    loads = [sum(lengths[s] for s in row) for row in layout]
    width = max(loads, default=1)
    # Where each sequence starts in the packed [B, W] rows, flat.
    starts = [0] * n_rows
    for b, row in enumerate(layout):
        offset = b * width
        for seq in row:
            starts[seq], offset = offset, offset + lengths[seq]
    device = attn.device
    real_pos = attn.long().cumsum(dim=-1) - 1  # 0..L-1 per sequence, as collate makes them
    start = torch.tensor(starts, dtype=torch.long, device=device)[:, None]
    flat = torch.where(attn, start + real_pos, -1)  # -1: padding
    ids = torch.zeros(len(layout) * width, dtype=tensors["input_ids"].dtype, device=device)
    ids[flat[attn]] = tensors["input_ids"][attn]
    # A row's padding tail counts 0, 1, ... from where its sequences end: a segment of its own.
    tail = torch.arange(width, device=device) - torch.tensor(loads, device=device)[:, None]
    positions = tail.reshape(-1)
    positions[flat[attn]] = real_pos[attn]
    r, c = attn[:, prompt_len:].nonzero(as_tuple=True)
    index = flat[:, prompt_len:][r, c] - 1
    keep, where = torch.unique(index % width, return_inverse=True)
    cu = None
    if one_row:
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    return Packed(
        input_ids=ids.view(len(layout), width),
        position_ids=positions.view(len(layout), width),
        logit_index=index,
        keep=keep,
        select=(index // width) * keep.numel() + where,
        targets=ids[index + 1],
        rows=r,
        cols=c,
        shape=(n_rows, resp_len),
        cu_seq_lens=cu,
        max_len=max(lengths, default=0),
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
    packed = pack(tensors, one_row=one_row(trunk))
    hidden = forward(trunk, packed).last_hidden_state
    return unpack(hidden.reshape(-1, hidden.shape[-1])[packed.logit_index], packed)


def forward(model: torch.nn.Module, packed: Packed, **kwargs: object) -> object:
    """`model`'s forward over a pack (`pack(..., one_row=one_row(model))`): boundaries from the
    position ids and, for a varlen attention, the cumulative lengths; no attention mask."""
    return model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=None,
        use_cache=False,
        **packed.attention_kwargs(),
        **kwargs,
    )


def one_row(model: torch.nn.Module) -> bool:
    """Whether `model`'s packed forwards take every sequence in one row: its attention reads
    the boundaries at no cost (varlen: `asyncrl.learner.varlen`, switched on here for an sdpa
    model, or flash-attention's); else (eager, flex, or a model `varlen` refuses) rows stay as short as the longest sequence."""
    if varlen.enable(model):
        return True
    impl = str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "")
    return "flash_attention" in impl

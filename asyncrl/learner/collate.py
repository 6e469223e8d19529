"""The learner's padded batch: `collate` turns a list of TrajectoryGroups into one `Batch` of
padded arrays, one row per response (verl's layout). Numpy only; `Batch.to_torch` imports torch
when it is called.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from asyncrl.types import NOT_GENERATED, UNROUTED, RecordError, TrajectoryGroup

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(eq=False)
class Batch:
    """Padded learner tensors in verl's layout, one row per response, rows in group order.

    Prompts are left-padded to the batch's longest prompt P, responses right-padded to its
    longest response R; `input_ids = [prompt | response]` has width P + R. Masks are 1 on real
    tokens; `response_mask` is the loss mask (0 on pad and on environment/tool tokens) and is
    float32 because the loss uses it as a weight. Pad positions hold `pad_id` in `input_ids`,
    0 in logprobs and advantages, and `NOT_GENERATED` in `versions`.
    """

    input_ids: np.ndarray  # [B, P+R] int64
    attention_mask: np.ndarray  # [B, P+R] int64
    position_ids: np.ndarray  # [B, P+R] int64: cumsum(attention_mask) - 1, clipped at 0
    response_mask: np.ndarray  # [B, R] float32
    rollout_logprobs: np.ndarray  # [B, R] float32
    advantages: np.ndarray  # [B, R] float32 (zeros for groups without advantages)
    versions: np.ndarray  # [B, R] int64
    rewards: np.ndarray  # [B] float32
    group_index: np.ndarray  # [B] int64: position of the row's group in collate's input
    prompt_lengths: np.ndarray  # [B] int64
    response_lengths: np.ndarray  # [B] int64
    # [B, P+R, layers * top_k] uint8: each position's routed experts (`UNROUTED` where none);
    # None when no group carries routes (a dense policy, or `actor.router_replay` off)
    routes: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return len(self.rewards)

    @property
    def response_width(self) -> int:
        return self.response_mask.shape[1]

    @property
    def prompt_width(self) -> int:
        return self.input_ids.shape[1] - self.response_width

    def to_torch(self, device: str = "cpu") -> dict[str, torch.Tensor]:
        """The batch as torch tensors (same names, same dtypes) on `device`."""
        import torch  # deferred: this module must not import torch at load time

        return {
            f.name: torch.from_numpy(getattr(self, f.name)).to(device)
            for f in fields(self)
            if getattr(self, f.name) is not None
        }


def collate(groups: Sequence[TrajectoryGroup], pad_id: int = 0) -> Batch:
    """Pad a list of groups into one `Batch` of B = sum(group.n) rows, in group order."""
    groups = list(groups)
    rows = sum(g.n for g in groups)
    if rows == 0:
        raise RecordError("collate needs at least one response")
    p = max(len(g.prompt_ids) for g in groups if g.n)
    r = max(int(g.response_lengths.max()) for g in groups if g.n)
    i64, f32 = np.int64, np.float32
    batch = Batch(
        input_ids=np.full((rows, p + r), pad_id, i64),
        attention_mask=np.zeros((rows, p + r), i64),
        position_ids=np.zeros((rows, p + r), i64),
        response_mask=np.zeros((rows, r), f32),
        rollout_logprobs=np.zeros((rows, r), f32),
        advantages=np.zeros((rows, r), f32),
        versions=np.full((rows, r), NOT_GENERATED, i64),
        rewards=np.zeros(rows, f32),
        group_index=np.zeros(rows, i64),
        prompt_lengths=np.zeros(rows, i64),
        response_lengths=np.zeros(rows, i64),
    )
    batch.routes = _route_array(groups, rows, p + r)
    row = 0
    for index, group in enumerate(groups):
        _fill_group(batch, group, index, row, p)
        row += group.n
    np.clip(np.cumsum(batch.attention_mask, axis=1) - 1, 0, None, out=batch.position_ids)
    return batch


def _fill_group(b: Batch, g: TrajectoryGroup, index: int, row: int, p: int) -> None:
    """Write group `g` into rows [row, row + g.n) of `b` (prompt width p)."""
    rows, plen = slice(row, row + g.n), len(g.prompt_ids)
    b.input_ids[rows, p - plen : p] = g.prompt_ids
    b.attention_mask[rows, p - plen : p] = 1
    # Scatter the flat token axis into (row, column) without a per-response Python loop.
    lengths = g.response_lengths
    r = np.repeat(np.arange(row, row + g.n), lengths)
    c = np.arange(g.num_tokens) - np.repeat(g.offsets()[:-1], lengths)
    b.input_ids[r, p + c] = g.response_ids
    b.attention_mask[r, p + c] = 1
    b.response_mask[r, c] = g.loss_mask
    b.rollout_logprobs[r, c] = g.rollout_logprobs
    b.versions[r, c] = g.versions
    if g.advantages is not None:
        b.advantages[r, c] = g.advantages
    if b.routes is not None and g.routes is not None:
        for i in range(g.n):  # the block's P + R_i positions end where the row's tokens do
            block = g.route_block(i)
            b.routes[row + i, p - plen : p - plen + len(block)] = block
    b.rewards[rows] = g.rewards
    b.group_index[rows] = index
    b.prompt_lengths[rows] = plen
    b.response_lengths[rows] = lengths


def _route_array(groups: list[TrajectoryGroup], rows: int, width: int) -> np.ndarray | None:
    """`UNROUTED` routes [rows, width, layers * top_k] when any group carries routes (groups
    without them route every position themselves); None when none does."""
    ids = {g.routes.shape[1] for g in groups if g.routes is not None}
    if not ids:
        return None
    if len(ids) > 1:
        raise RecordError(f"groups carry routes of different widths {sorted(ids)}")
    return np.full((rows, width, ids.pop()), UNROUTED, np.uint8)

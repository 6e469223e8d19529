"""The hf engine's KV cache for decode steps: appended in place, not copied every step.

transformers' `DynamicCache` concatenates each step's new keys and values onto the cache (and
`DynamicCache(kv)` first copies every layer's tensors in): two copies of the whole cache per
layer per decode step, quadratic in the response length (14 % of a 64-token decode step's
forward on the CPU engine, measured). Here a layer's keys are a view of the first T columns
of a buffer with room for more; a step writes its column into that room and widens the view.
When the room is used up the buffer is reallocated with as much again: the cache is copied
once per doubling of its length, not once per step.

Invariant: the buffer behind a running batch's KV belongs to that batch alone: a view is
only ever widened by the batch that holds it (`KVBatch.select` and `merge` make new tensors,
and a batch's kv is replaced by the widened views each step), so writing past a view's end
never overwrites anything another tensor shows.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers is imported only for a model the lean decoder refuses
    from transformers import DynamicCache


def capacity(view: torch.Tensor) -> int:
    """Columns (dim 2) the storage behind `view` ([B, H, T, D]) holds from column 0 in the
    layout of a [B, H, C, D] buffer, or T when `view` is not such a prefix."""
    b, h, t, d = view.shape
    s0, s1, s2, s3 = view.stride()
    if view.storage_offset() != 0 or s3 != 1 or s2 != d or d == 0 or s1 % d:
        return t
    cols = s1 // d
    whole = b * h * cols * d * view.element_size()
    if cols < t or s0 != h * cols * d or view.untyped_storage().nbytes() < whole:
        return t
    return cols


def append(view: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`view` ([B, H, T, D]) with `new` ([B, H, A, D]) after it: written into the room of its
    buffer when there is some, else into a new buffer with room for as many columns again."""
    b, h, t, d = view.shape
    cols = capacity(view)
    if t + new.shape[2] <= cols:
        buf = view.as_strided((b, h, cols, d), view.stride())
    else:
        cols = 2 * (t + new.shape[2])
        buf = view.new_empty((b, h, cols, d))
        buf[:, :, :t] = view
    buf[:, :, t : t + new.shape[2]] = new
    return buf[:, :, : t + new.shape[2]]


@functools.cache
def slack_layer() -> type:
    """A `DynamicLayer` over given keys and values whose `update` appends in place (made on
    first use: transformers is imported only when its forward runs)."""
    from transformers.cache_utils import DynamicLayer

    class SlackLayer(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            super().__init__()
            self.device, self.keys, self.values = keys.device, keys, values
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            self.keys = append(self.keys, key_states)
            self.values = append(self.values, value_states)
            return self.keys, self.values

    return SlackLayer


def decode_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A cache holding `kv` (one (keys, values) per layer) as they are, no copy."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layers = [slack_layer()(k, v) for k, v in kv]
    return cache

"""A lean forward for the hf engine's Llama-family decoders (Qwen2, Llama), fp32-equal to
transformers' own.

Why: on the CPU engine a decode step of the embedded model is small matmuls wrapped in
transformers' per-call machinery (a 4-D mask built from the padding mask every call, the
rotary module, output dataclasses, cache objects, module hooks): at 64 padded rows the linear
layers are ~0.7 ms of a ~2.4 ms step. This runs the same arithmetic on the model's own
parameters (read from its modules at every call, so weight updates loaded into the model in
place are seen at once: nothing is copied or fused) and keeps the KV cache as the engine's
(keys, values) per layer, appended in place (`kvcache.append`). Measured on one core (the
embedded 2-layer model): decode 2.4 -> 1.6 ms at 64 rows, 1.4 -> 0.8 ms at 16; the default
run's rollout batch (8 prompts x 8 samples) 15.7 -> 11.9 ms of engine time; 256-row prefills
are matmul-bound and gain ~10 %.

The arithmetic is `asyncrl/llama.py`'s (shared with the learner's lean training forward), and
so is the rule of what is taken (`lean_forward_for` returns None otherwise and the engine runs
transformers' forward), in the model's dtype on any device. `tests/test_decoder.py` holds it to
transformers' logits and KV on prefill (left padding) and decode (rows of different lengths).

Attention masks: a prefill row attends causally to its own non-padding positions (a padding
position to itself: `llama.prefill_mask`); decode rows attend to every unmasked column.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from asyncrl import llama
from asyncrl.engine.hf.kvcache import append

log = logging.getLogger(__name__)
KV = list[tuple[torch.Tensor, torch.Tensor]]
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, KV | None], tuple[torch.Tensor, KV]]


def lean_forward_for(model: torch.nn.Module) -> Forward | None:
    """`forward(ids, mask, pos, kv) -> (last logits [B, V], kv)` for `model`, or None when
    the model is not one `asyncrl.llama` reproduces exactly."""
    if (why := llama.unsupported(model)) is not None:
        log.info("hf engine: transformers' forward for this model (%s)", why)
        return None
    return _Decoder(llama.Llama(model))


class _Decoder:
    def __init__(self, ops: llama.Llama) -> None:
        self.ops = ops

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, kv: KV | None
    ) -> tuple[torch.Tensor, KV]:
        ops = self.ops
        if kv is None:  # prefill
            h, out = ops.blocks(ops.embed(ids), pos, llama.prefill_mask(mask))
        else:  # decode: the new token after each layer's cache, appended in place
            join = lambda i, k, v: (append(kv[i][0], k), append(kv[i][1], v))  # noqa: E731
            h, out = ops.blocks(ops.embed(ids), pos, mask[:, None, None, :].bool(), join)
        return ops.logits(h[:, -1]), out

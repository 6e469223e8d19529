"""The learner's lean training forward: `logprobs.shared_prompt_logits` (each group's prompt run
once, its rows' responses against the prompt's keys and values) computed with `asyncrl.llama`'s
arithmetic on the policy's own parameters instead of transformers' forward.

Why: the embedded default trains on ~11-token rows (a 7-token prompt, ~4 response tokens), where
a learner step is per-op overhead, not matmuls: transformers' two forwards build 4-D masks,
rotary tables, cache objects and output dataclasses, and project every prompt position through
the LM head although only the last predicts a response token. Measured on one core (8 x 8 rows,
fwd + bwd of the training forward): 27 -> 22.5 ms. The values are transformers' (the same
arithmetic; `tests/test_lean_learner.py` holds logits and gradients to them), so nothing about
training changes but its cost.

Taken where `asyncrl.llama` reproduces the model (`unsupported`) and the training forward is
deterministic (no dropout: transformers applies attention dropout inline, this does not), on
one process (FSDP2 gathers parameters in the layers' hooks; `unsupported` refuses hooks
anyway) and without `actor.use_torch_compile` (a compiled forward was asked for); else
`shared_prompt_logits` runs, and one info line says why.

Which of the paths a micro-batch runs (each group's prompt once with the responses under a mask
or laid out causally, or every row whole) is `learner/prompt_rule.py`'s cost model's choice.
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from asyncrl import llama
from asyncrl.config.schema import ActorConfig, WorkerConfig
from asyncrl.learner import prompt_rule
from asyncrl.learner.chunked import Projection
from asyncrl.learner.logprobs import (
    LogitsFn,
    has_dropout,
    prompt_owners,
    response_logits,
    shared_prompt_logits,
)

log = logging.getLogger(__name__)


def training_logits_fn(
    model: torch.nn.Module, train: WorkerConfig, actor: ActorConfig, world_size: int
) -> LogitsFn | None:
    """The padded training forward's logits: every row whole (None), or, with
    `actor.share_prompt_forward` where the layers keep the KV cache (not packed, not
    checkpointed: checkpointed layers drop it), a `prompt_rule.SharedPromptRule` that runs each
    micro-batch each group's prompt once or every row whole, whichever its cost model says is
    cheaper: in the lean forward where it is taken on one process without
    `actor.use_torch_compile` (which can also lay the responses out causally), else
    `shared_prompt_logits`."""
    shared = actor.share_prompt_forward and not actor.use_dynamic_bsz
    if not shared or train.model_args.actor_checkpointing():
        return None
    plain = world_size == 1 and not actor.use_torch_compile  # no FSDP gathers, nothing compiled
    lean = lean_shared_logits_for(model) if plain else None
    if lean is None:
        paths = {prompt_rule.SHARED: shared_prompt_logits}
    else:
        causal = partial(lean.func, *lean.args, causal=True)
        paths = {prompt_rule.SHARED: lean, prompt_rule.SHARED_CAUSAL: causal}
    paths[prompt_rule.WHOLE] = response_logits
    return prompt_rule.SharedPromptRule(model, paths, agree=world_size > 1)


def lean_shared_logits_for(model: torch.nn.Module) -> LogitsFn | None:
    """A `LogitsFn` equal to `shared_prompt_logits` on `model`, or None where it is not taken."""
    why = llama.unsupported(model) or ("dropout" if has_dropout(model) else None)
    if why is not None:
        log.info("learner: transformers' training forward for this model (%s)", why)
        return None
    return partial(_shared_prompt_logits, llama.Llama(model))


def _shared_prompt_logits(
    ops: llama.Llama, model: torch.nn.Module, tensors: dict[str, torch.Tensor], causal: bool = False
) -> Projection:
    """[B, R, V] logits predicting each response token (`model` is `ops.model`), as the final
    hidden states and the LM head (`logprobs.Logits`: projected in chunks). The prompt pass
    runs one row per group and keeps each layer's (k, v); the response pass gathers them out
    to the group's rows and attends to them, causally over the row's own tokens: under a mask,
    or (`causal`) laid out for SDPA's causal kernel (`_causal_attend`)."""
    resp_len = tensors["response_mask"].shape[1]
    prompt_len = tensors["input_ids"].shape[1] - resp_len
    ids, mask, pos = tensors["input_ids"], tensors["attention_mask"], tensors["position_ids"]
    heads, owner = prompt_owners(tensors["group_index"])
    prompt_mask = mask[heads, :prompt_len]
    # no padding: SDPA's causal kernel (it skips the keys after each query; a mask's computes them)
    prefill = None if prompt_mask.bool().all() else llama.prefill_mask(prompt_mask)
    h, prompt_kv = ops.blocks(ops.embed(ids[heads, :prompt_len]), pos[heads, :prompt_len], prefill)
    # The prompt's last position (never padding: prompts are left-padded) predicts token 0.
    first = llama.norm(h[:, -1], model.model.norm)[owner]

    def join(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_p, v_p = prompt_kv[i]  # the group's prompt, gathered out to each of its rows
        return torch.cat([k_p[owner], k], dim=2), torch.cat([v_p[owner], v], dim=2)

    attend = _causal_attend(ops, mask, prompt_len) if causal else _response_mask(mask, prompt_len)
    h, _ = ops.blocks(ops.embed(ids[:, prompt_len:]), pos[:, prompt_len:], attend, join)
    # Response token j predicts token j + 1: the last response position predicts nothing.
    rest = llama.norm(h[:, : resp_len - 1], model.model.norm)
    head = model.lm_head  # `llama.unsupported`: a plain linear layer
    return Projection(torch.cat([first[:, None], rest], dim=1), head.weight, head.bias)


def _response_mask(mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[B, 1, R, P + R] booleans: response query j sees the row's non-padding keys up to its
    own column P + j. No query is left without a key (every row has a prompt token), so a
    padding query's unused outputs stay finite; responses are right-padded, so every key a
    real query sees is real."""
    total = mask.shape[1]
    causal = torch.ones(total - prompt_len, total, dtype=torch.bool, device=mask.device)
    return mask[:, None, None, :].bool() & causal.tril(prompt_len)


def _causal_attend(ops: llama.Llama, mask: torch.Tensor, prompt_len: int) -> llama.Attend:
    """The responses' attention over [prompt | response] keys through SDPA's causal kernel,
    which computes about half the query-key pairs a mask's does at a long response. Each row is
    laid out as [its real prompt | its response | its prompt's left padding] (a rotation by the
    padding, the same for queries, keys and values), with zero queries in the prompt's places:
    response query t then sits at place p + t (p: the real prompt's length) and sees exactly
    the real prompt and responses 0..t; the padding keys come after every real query, seen only
    by unused queries (finite). Positions are in the rotary embedding already, so the layout
    changes nothing but which pairs are computed."""
    rows, width = mask.shape
    pad = prompt_len - mask[:, :prompt_len].sum(-1)  # each row's left padding
    cols = torch.arange(width, device=mask.device)
    rotate = (cols + pad[:, None]) % width if bool(pad.any()) else None  # place -> column
    resp = cols[prompt_len:] - pad[:, None]  # the place of each response column

    def along(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x.gather(2, index[:, None, :, None].expand(*x.shape[:2], index.shape[1], x.shape[3]))

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q = torch.cat([q.new_zeros(*q.shape[:2], prompt_len, q.shape[3]), q], dim=2)
        if rotate is None:
            return ops.attention(q, k, v, None)[:, :, prompt_len:]
        o = ops.attention(along(q, rotate), along(k, rotate), along(v, rotate), None)
        return along(o, resp)

    return attend

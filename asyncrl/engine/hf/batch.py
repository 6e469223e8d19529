"""Request state, sampling and the left-padded KV batch of the hf engine (no threads here).

A running batch keeps one KV tensor pair per layer, `[B, heads, T, head_dim]`, left-padded:
row i's real tokens sit at the right end of the time axis and `mask[i]` marks them. Positions
are explicit per row (RoPE is applied before caching, so padding never shifts a position).
Rows join by left-padding the shorter of two batches along time and concatenating; rows leave
by index selection; all-padding leading columns are trimmed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Sampling keys accepted only at their neutral value (the hf server does not implement them);
# anything else is rejected so a caller never silently gets a different distribution.
_NEUTRAL = {
    "n": (1,),
    "stop": (None, [], ""),
    "min_new_tokens": (0, None),
    "repetition_penalty": (1.0, None),
    "frequency_penalty": (0.0, None),
    "presence_penalty": (0.0, None),
    "min_p": (0.0, None),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "logit_bias": (None, {}),
}
# Keys that only affect detokenisation or streaming: meaningless without a tokenizer.
_IGNORED = {
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
}


class RequestError(ValueError):
    """A malformed generate request (answered with HTTP 400)."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _num(d: dict, key: str, default: float) -> float:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        raise RequestError(f"sampling_params.{key} must be a finite number, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    sampling_seed: int | None = None

    @classmethod
    def from_json(cls, d: object) -> SamplingParams:
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise RequestError("sampling_params must be an object")
        for key, value in d.items():
            if key in _NEUTRAL and value not in _NEUTRAL[key]:
                raise RequestError(f"sampling_params.{key}={value!r} is not supported here")
            if key not in _NEUTRAL and key not in _IGNORED and key not in _FIELDS:
                raise RequestError(f"unknown sampling_params key {key!r}")
        mnt = d.get("max_new_tokens", 128)
        if not _is_int(mnt) or mnt < 0:
            raise RequestError(f"sampling_params.max_new_tokens must be an int >= 0, got {mnt!r}")
        top_k = d.get("top_k", -1)
        if not _is_int(top_k) or top_k == 0 or top_k < -1:
            raise RequestError(f"sampling_params.top_k must be -1 or >= 1, got {top_k!r}")
        stop = d.get("stop_token_ids") or []
        if not isinstance(stop, list) or not all(_is_int(t) for t in stop):
            raise RequestError("sampling_params.stop_token_ids must be a list of ints")
        seed = d.get("sampling_seed")
        if seed is not None and not _is_int(seed):
            raise RequestError("sampling_params.sampling_seed must be an int")
        temperature, top_p = _num(d, "temperature", 1.0), _num(d, "top_p", 1.0)
        if temperature < 0 or not 0 < top_p <= 1:
            raise RequestError("sampling_params: need temperature >= 0 and 0 < top_p <= 1")
        return cls(
            max_new_tokens=mnt,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=frozenset(stop),
            ignore_eos=bool(d.get("ignore_eos", False)),
            sampling_seed=seed,
        )


_FIELDS = {f for f in SamplingParams.__dataclass_fields__}


@dataclass(eq=False)
class Seq:
    """One request's life in the engine. `on_done` runs once, on the scheduler thread."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    on_done: Callable[[Seq], None]
    return_logprob: bool = False
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[str] = field(default_factory=list)  # weight version per output token
    finish: dict | None = None
    generator: torch.Generator | None = None
    weight_version: str = ""
    created: float = field(default_factory=time.monotonic)

    def tokens(self) -> list[int]:
        return self.prompt + self.output_ids


@dataclass(eq=False)
class KVBatch:
    seqs: list[Seq]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor  # [B, T] long, 1 = real token
    pos: torch.Tensor  # [B] position of the next input token (= tokens already cached)
    last: torch.Tensor  # [B] next input token (sampled, not yet cached)

    def select(self, keep: list[int]) -> KVBatch | None:
        """Rows `keep` only (None when empty), leading all-padding columns trimmed."""
        if not keep:
            return None
        if len(keep) == len(self.seqs):
            return self
        idx = torch.tensor(keep, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        start = int(mask.any(0).nonzero()[0]) if mask.any() else 0
        kv = [
            (k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:])
            for k, v in self.kv
        ]
        return KVBatch(
            seqs=[self.seqs[i] for i in keep],
            kv=kv,
            mask=mask[:, start:],
            pos=self.pos.index_select(0, idx),
            last=self.last.index_select(0, idx),
        )


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    if width == 0:
        return t
    shape = list(t.shape)
    shape[dim] = width
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def merge(a: KVBatch | None, b: KVBatch | None) -> KVBatch | None:
    """Concatenate two batches along the batch axis, left-padding the shorter in time."""
    if a is None or b is None:
        return a if b is None else b
    ta, tb = a.mask.shape[1], b.mask.shape[1]
    t = max(ta, tb)
    kv = [
        (
            torch.cat([_left_pad(ka, t - ta, 2), _left_pad(kb, t - tb, 2)]),
            torch.cat([_left_pad(va, t - ta, 2), _left_pad(vb, t - tb, 2)]),
        )
        for (ka, va), (kb, vb) in zip(a.kv, b.kv, strict=True)
    ]
    return KVBatch(
        seqs=a.seqs + b.seqs,
        kv=kv,
        mask=torch.cat([_left_pad(a.mask, t - ta, 1), _left_pad(b.mask, t - tb, 1)]),
        pos=torch.cat([a.pos, b.pos]),
        last=torch.cat([a.last, b.last]),
    )


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) >= top_p  # keep the token crossing top_p
        scaled = scaled.clone()
        scaled[order[drop]] = float("-inf")
    return scaled


def sample(logits: torch.Tensor, seqs: list[Seq]) -> tuple[list[int], list[float]]:
    """Next token and its logprob per row.

    The logprob is `log_softmax(logits / temperature)` at the sampled token, top-k/top-p NOT
    reflected (SGLang's convention); temperature 0 is greedy with the raw logits' logprob.
    Each request draws from its own generator, so its samples do not depend on batch mates.
    """
    logits = logits.float().cpu()
    temps = torch.tensor([s.params.temperature or 1.0 for s in seqs]).unsqueeze(1)
    scaled = logits / temps
    logp = torch.log_softmax(scaled, dim=-1)
    tokens: list[int] = []
    for i, s in enumerate(seqs):
        p = s.params
        if p.temperature == 0:
            tok = int(torch.argmax(logits[i]))
        else:
            filtered = _filter_top_k_top_p(scaled[i], p.top_k, p.top_p)
            probs = torch.softmax(filtered, dim=-1)
            tok = int(torch.multinomial(probs, 1, generator=s.generator))
        tokens.append(tok)
    lps = [float(logp[i, t]) for i, t in enumerate(tokens)]
    return tokens, lps

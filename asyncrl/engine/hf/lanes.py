"""The hf engine's lanes, its step lock and the model's EOS ids (no scheduling policy here).

A lane is one set of weights and the running rows it serves. The engine has one live lane (the
weights that weight updates change) and, while requests pinned to an older weight version are
unfinished, a kept lane per such version: a copy of the model as it was, which no update
touches. Each lane runs its own forward passes: rows of two versions never share a batch.

A version's lease (`linger_s` > 0): a version that a pinned request used (arrived at or
ended on) less than `linger_s` ago is kept as if a request still ran on it, so the next turn
of a multi-turn episode, pinned to it and sent only once the previous turn came back, is
still served after a weight update replaced it. Each pinned request renews the lease.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import threading
import time
from collections.abc import Callable, Iterator

import torch

from asyncrl.engine.hf import routes
from asyncrl.engine.hf.batch import KVBatch, Seq
from asyncrl.engine.hf.decoder import lean_forward_for
from asyncrl.engine.hf.kvcache import decode_cache


class StepLock:
    """The engine's `step_lock`: a re-entrant lock that a waiting control call gets next.

    A bare RLock is not fair: the scheduler thread re-takes it right after letting it go, so a
    pause, abort or weight load could wait hundreds of steps for it. Control calls use it as a
    plain lock (`with engine.step_lock`); the scheduler enters each step through `step()`,
    which first lets every control call already waiting through. So a control call waits for
    the step in progress at most.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0  # control calls blocked in acquire()

    def acquire(self) -> bool:
        with self._cond:
            self._waiting += 1
        try:
            return self._lock.acquire()
        finally:
            with self._cond:
                self._waiting -= 1
                self._cond.notify_all()

    def release(self) -> None:
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """For the scheduler: hold the lock for one step, after any waiting control call."""
        with self._cond:
            self._cond.wait_for(lambda: self._waiting == 0)
        with self._lock:
            yield


class Lane:
    """`model` at weight `version` and `batch`, the running rows it serves (None: none)."""

    def __init__(self, model: torch.nn.Module, version: str) -> None:
        self.model, self.version = model, version
        self.batch: KVBatch | None = None
        self.device = next(model.parameters()).device
        # Only the last position's logits are needed; older model classes lack the argument.
        accepts = inspect.signature(model.forward).parameters
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in accepts else {}
        self._lean = lean_forward_for(model)  # None: transformers' forward (decoder.py)
        self.tap = routes.tap_for(model)  # MoE: forwards record routes when asked (routes.py)

    @property
    def running(self) -> list[Seq]:
        return [] if self.batch is None else self.batch.seqs

    def _forward(self, ids, mask, pos, kv):
        if self._lean is not None:
            return self._lean(ids, mask, pos, kv)
        from transformers import DynamicCache  # only here: a model the lean decoder refuses

        cache = decode_cache(kv) if kv else DynamicCache()  # appended in place (kvcache.py)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            **self._last_only,
        )
        kv = [(layer[0], layer[1]) for layer in out.past_key_values]
        return out.logits[:, -1, :], kv

    def prefill(self, seqs: list[Seq]) -> tuple[KVBatch, torch.Tensor]:
        """`seqs` prefilled together (left-padded): their KV batch and last logits."""
        rows = [tuple(s.tokens()) for s in seqs]  # a retracted one: with its partial output
        # A group's n samples share one prompt: each distinct row runs once (the costliest
        # forward, n x cheaper) and every request gets a copy of that row's KV and logits.
        first: dict[tuple[int, ...], int] = {}
        inverse = [first.setdefault(r, len(first)) for r in rows]
        width = max(len(r) for r in first)
        ids = torch.zeros(len(first), width, dtype=torch.long)
        mask = torch.zeros(len(first), width, dtype=torch.long)
        for i, r in enumerate(first):
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        routed = routes.begin(self.tap, seqs)
        logits, kv = self._forward(ids, mask, pos, None)
        if routed:
            routes.after_prefill(self.tap, seqs, inverse, width, [len(r) for r in rows])
        if len(first) < len(rows):
            idx = torch.tensor(inverse, device=self.device)
            logits, mask = logits.index_select(0, idx), mask.index_select(0, idx)
            kv = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in kv]
        lengths = torch.tensor([len(r) for r in rows], device=self.device)
        return KVBatch(seqs, kv, mask, lengths, torch.zeros_like(lengths)), logits

    def decode(self) -> torch.Tensor:
        """One token's forward for every running row (the batch's KV grows by it): logits."""
        b = self.batch
        assert b is not None
        mask = torch.cat([b.mask, b.mask.new_ones(len(b.seqs), 1)], dim=1)
        routed = routes.begin(self.tap, b.seqs)
        logits, kv = self._forward(b.last[:, None], mask, b.pos[:, None], b.kv)
        if routed:
            routes.after_decode(self.tap, b.seqs)
        b.kv, b.mask, b.pos = kv, mask, b.pos + 1
        return logits


class Lanes:
    """The live lane and the kept ones (at most `max_kept`, oldest first), and which serves a
    request. Caller holds the engine's `_cond`."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_kept: int,
        linger_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_kept < 0:
            raise ValueError(f"max_pinned_versions must be >= 0, got {max_kept}")
        if not linger_s >= 0:
            raise ValueError(f"pinned_linger_s must be >= 0, got {linger_s}")
        self.live = Lane(model, "default")
        self.kept: dict[str, Lane] = {}  # version -> a copy serving the requests pinned to it
        self.max_kept = max_kept
        self.pinnable = True  # the live weights are still those of `live.version`
        self.linger_s, self._clock = linger_s, clock
        # version -> when a pinned request last arrived at or ended on it (leases only)
        self._used: dict[str, float] = {}

    def touch(self, version: str | None) -> None:
        """A request pinned to `version` arrived or ended: its lease runs `linger_s` from now
        (None: an unpinned request, nothing to lease)."""
        if version is not None and self.linger_s > 0:
            self._used[version] = self._clock()

    def leased(self, version: str) -> bool:
        used = self._used.get(version)
        return used is not None and self._clock() - used < self.linger_s

    def unused(self, version: str, waiting: list[Seq]) -> bool:
        """A kept version with no running row and no waiting request (a lease at most)."""
        return self.kept[version].batch is None and all(s.pin != version for s in waiting)

    def all(self) -> list[Lane]:
        return [self.live, *self.kept.values()]

    def route(self, seq: Seq) -> Lane | None:
        """The lane that serves `seq`: the live one, unless it is pinned to another version
        (a kept lane; None when that version is not served here)."""
        if seq.pin is None:
            return self.live
        if seq.pin in self.kept:
            return self.kept[seq.pin]
        return self.live if seq.pin == self.live.version and self.pinnable else None

    def __str__(self) -> str:
        """What it serves, for an error message."""
        live = self.live.version if self.pinnable else f"none ({self.live.version} updating)"
        return f"it serves {live}, kept {sorted(self.kept) or 'none'}"

    def keep_live(self, rows: list[int]) -> None:
        """Copy the live model into a kept lane of its version, which takes the live batch's
        `rows` (their KV) along; room for it is the caller's to make."""
        live = self.live
        lane = self.kept[live.version] = Lane(copy.deepcopy(live.model), live.version)
        if live.batch is not None:
            moved = set(rows)
            others = [i for i in range(len(live.running)) if i not in moved]
            lane.batch, live.batch = live.batch.select(rows), live.batch.select(others)

    def drop_idle(self, waiting: list[Seq]) -> None:
        """Drop the kept lanes that run nothing, that no waiting request is pinned to and
        whose lease ran out; forget the leases of versions served no more."""
        for version in [v for v in self.kept if self.unused(v, waiting) and not self.leased(v)]:
            del self.kept[version]
        served = {self.live.version, *self.kept}
        for version in [v for v in self._used if v not in served]:
            del self._used[version]

    def evictee(self, waiting: list[Seq]) -> str:
        """The kept version to drop for room: the oldest that only a lease keeps (no request
        of it fails), else the oldest."""
        return next((v for v in self.kept if self.unused(v, waiting)), next(iter(self.kept)))


def eos_ids(model: torch.nn.Module) -> frozenset[int]:
    """The token ids that end a response: the model's and its generation config's EOS."""
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return frozenset(ids)

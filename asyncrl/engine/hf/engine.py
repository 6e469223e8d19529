"""The hf engine: a transformers causal LM behind a step-level dynamic batching scheduler.

One scheduler thread owns the model. Each iteration, under `step_lock`:
  1. admit: waiting requests (up to `max_batch_size` running in all) are prefilled together
     (left-padded) and their KV joins the running batch -- new requests join at step
     boundaries, they never wait for the current batch to drain;
  2. decode: one token for every running row;
  3. finished rows (stop token, max_new_tokens, context limit) leave the batch and are
     answered.
Admission is by priority, SGLang's convention (`priority` on /generate, a larger value first,
as `--enable-priority-scheduling` without `--schedule-low-priority-values-first`; null = 0):
FIFO within a priority, and a free slot always goes to a waiting request, so a low-priority
request runs whenever no higher one waits. Running requests are never preempted for priority
(SGLang preempts when the gap reaches `--priority-scheduling-preemption-threshold`, 10): an
evaluation request at -1 below rollout at 0 only waits for its turn.
Control calls (pause/continue/abort/flush/weight load) take `step_lock`, so they act between
steps and never see a half-done step; `step_lock` is fair to them (a waiting control call goes
before the next step), so one acts within the step in progress. Lock order is always
`step_lock` then `_cond`.

Pause modes (SGLang's): `abort` finishes every running and waiting request now with
finish_reason abort (partial output returned); `retract` drops the running rows' KV and puts
them back at the head of the queue with their partial tokens and logprobs kept (after
continue they are re-prefilled from prompt + partial output and carry on); `in_place` just
stops stepping (KV kept). In every mode new requests queue until `resume()`.

No request takes the scheduler down: a step that raises fails the requests it was serving
(prefill: the ones it admitted; decode: the running batch) with the error, drops their KV, and
the scheduler goes on with the next step. A row whose logits are broken fails alone. Only an
exception outside a step (a bug in the loop itself) stops the scheduler; then every request is
failed, `alive` turns False and the server reports it (`/health`, `/health_generate`: 503).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import random
import threading
from collections import deque
from collections.abc import Iterator

import torch
from transformers import DynamicCache

from asyncrl.engine.hf.batch import KVBatch, Seq, merge, sample

log = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "retract", "in_place")


class EngineDeadError(RuntimeError):
    """The scheduler thread is not running: the engine cannot serve (answered with HTTP 503)."""


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


class HFEngine:
    def __init__(self, model: torch.nn.Module, *, max_batch_size: int = 32, seed: int = 0) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        cfg = model.config
        self.max_context = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(cfg.vocab_size)
        self.eos_ids = _eos_ids(model)
        # Only the last position's logits are needed; older model classes lack the argument.
        accepts = inspect.signature(model.forward).parameters
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in accepts else {}
        self.weight_version = "default"
        self.step_lock = StepLock()
        self._cond = threading.Condition(threading.Lock())
        self._waiting: deque[Seq] = deque()
        self._batch: KVBatch | None = None
        self._paused = False
        self._stopping = False
        self._seed_rng = random.Random(seed)
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self.error: BaseException | None = None
        self.step_failures = 0  # steps that raised (their requests failed, the engine went on)
        self.last_step_ok = True

    # ---- called from other threads -------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def paused(self) -> bool:
        return self._paused

    def check(self, seq: Seq) -> None:
        """Raise ValueError if the engine cannot serve `seq` (tokens, length), EngineDeadError
        if the scheduler is not running."""
        if self.error is not None:
            raise EngineDeadError(f"engine scheduler died: {_describe(self.error)}")
        bad = [t for t in seq.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids has token {bad[0]} outside vocab [0, {self.vocab_size})")
        if not seq.prompt:
            raise ValueError("input_ids is empty")
        if len(seq.prompt) >= self.max_context:
            raise ValueError(f"prompt of {len(seq.prompt)} tokens >= context {self.max_context}")

    def submit(self, seq: Seq) -> None:
        """Queue a request; it is answered through `seq.on_done` on the scheduler thread."""
        self.check(seq)
        with self._cond:
            if seq.params.temperature > 0:
                seed = seq.params.sampling_seed
                seed = self._seed_rng.getrandbits(63) if seed is None else seed
                seq.generator = torch.Generator().manual_seed(seed)
            if seq.params.max_new_tokens == 0:
                self._finish(seq, {"type": "length", "length": 0})
                return
            self._waiting.append(seq)
            self._cond.notify_all()

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; expected one of {PAUSE_MODES}")
        with self.step_lock, self._cond:
            self._paused = True
            if mode == "abort":
                self._abort_where(lambda s: True, "aborted by pause_generation(abort)")
            elif mode == "retract" and self._batch is not None:
                self._waiting.extendleft(reversed(self._batch.seqs))
                self._batch = None

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def abort(self, rid: str | None = None) -> int:
        """Abort one request by rid (None: all). Returns how many were aborted."""
        with self.step_lock, self._cond:
            return self._abort_where(lambda s: rid is None or s.rid == rid, "aborted by request")

    def num_requests(self) -> int:
        with self._cond:
            running = 0 if self._batch is None else len(self._batch.seqs)
            return running + len(self._waiting)

    def load(self) -> dict[str, int]:
        """SGLang's `/get_load` numbers, read between steps: requests running or waiting, those
        waiting, and the tokens (prompt + output) the running requests hold in KV."""
        with self.step_lock, self._cond:
            running = [] if self._batch is None else self._batch.seqs
            return {
                "num_reqs": len(running) + len(self._waiting),
                "num_waiting_reqs": len(self._waiting),
                "num_tokens": sum(len(s.prompt) + len(s.output_ids) for s in running),
            }

    def flush_cache(self) -> bool:
        """There is no prefix cache to drop; refuse (False) while any request holds KV.

        As SGLang: running requests -> refused (in_place pause keeps them running); after a
        retract the queued requests hold no KV, so a paused engine may flush. Unpaused waiting
        requests are about to run, so they count as running.
        """
        with self.step_lock, self._cond:
            return self._batch is None and (self._paused or not self._waiting)

    # ---- scheduler thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._wait_for_work():
                with self.step_lock.step():
                    self._step()
        except BaseException as e:  # a dead scheduler must fail requests, not hang them
            log.exception("hf engine scheduler died")
            self.error = e
            with self._cond:
                self._abort_where(lambda s: True, f"engine scheduler died: {_describe(e)}", True)

    def _step(self) -> None:
        """Admit waiting requests (prefill), then decode one token for the running batch. Each
        half that raises fails only its own requests; the scheduler carries on."""
        with self._cond:
            if self._paused:
                return
            free = self.max_batch_size - (len(self._batch.seqs) if self._batch else 0)
            admit = self._take_waiting(free)
        ok = True
        with torch.inference_mode():
            if admit:
                try:
                    self._batch = merge(self._batch, self._prefill(admit))
                except Exception as e:  # the running batch is untouched: only `admit` fails
                    ok = self._fail_step(admit, "prefill", e)
            if self._batch is not None:
                try:
                    self._decode()
                except Exception as e:  # the batch's KV may be half updated: drop it whole
                    batch, self._batch = self._batch, None
                    ok = self._fail_step(batch.seqs, "decode", e)
        self.last_step_ok = ok

    def _take_waiting(self, n: int) -> list[Seq]:
        """Up to `n` waiting requests, removed from the queue: the highest `priority` first,
        queue order within one priority (FIFO, retracted requests at the head). A request waits
        only while a higher-priority one holds the slot it would take, so it runs as soon as
        none waits (no aging: a steady stream of higher-priority work can hold it, as in
        SGLang). Caller holds `_cond`."""
        if n <= 0 or not self._waiting:
            return []
        queue = list(self._waiting)
        admit = sorted(queue, key=lambda s: -s.priority)[:n]  # stable: FIFO within a priority
        taken = {id(s) for s in admit}
        self._waiting = deque(s for s in queue if id(s) not in taken)
        return admit

    def _fail_step(self, seqs: list[Seq], what: str, e: Exception) -> bool:
        log.exception("hf engine: %s step failed; failing its %d request(s)", what, len(seqs))
        self.step_failures += 1
        for s in seqs:
            if s.finish is None:  # some may have finished within the step before it raised
                self._fail(s, f"engine {what} step failed: {_describe(e)}")
        return False

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._stopping and (self._paused or not (self._waiting or self._batch)):
                self._cond.wait()
            return not self._stopping

    def _forward(self, ids, mask, pos, kv):
        cache = DynamicCache(kv) if kv else DynamicCache()
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

    def _prefill(self, seqs: list[Seq]) -> KVBatch | None:
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
        logits, kv = self._forward(ids, mask, pos, None)
        if len(first) < len(rows):
            idx = torch.tensor(inverse, device=self.device)
            logits, mask = logits.index_select(0, idx), mask.index_select(0, idx)
            kv = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in kv]
        lengths = torch.tensor([len(r) for r in rows], device=self.device)
        batch = KVBatch(seqs, kv, mask, lengths, torch.zeros_like(lengths))
        return self._sample_and_retire(batch, logits)

    def _decode(self) -> None:
        b = self._batch
        mask = torch.cat([b.mask, b.mask.new_ones(len(b.seqs), 1)], dim=1)
        logits, kv = self._forward(b.last[:, None], mask, b.pos[:, None], b.kv)
        b.kv, b.mask, b.pos = kv, mask, b.pos + 1
        self._batch = self._sample_and_retire(b, logits)

    def _sample_and_retire(self, b: KVBatch, logits: torch.Tensor) -> KVBatch | None:
        tokens, lps, errors = sample(logits, b.seqs)
        b.last = torch.tensor(tokens, device=self.device)
        keep = []
        for i, (s, tok, lp, err) in enumerate(zip(b.seqs, tokens, lps, errors)):
            if err is not None:
                self._fail(s, err)
                continue
            s.output_ids.append(tok)
            s.logprobs.append(lp)
            s.token_versions.append(self.weight_version)
            stop = tok in s.params.stop_token_ids or (
                tok in self.eos_ids and not s.params.ignore_eos
            )
            if stop:
                self._finish(s, {"type": "stop", "matched": tok})
            elif len(s.output_ids) >= s.params.max_new_tokens:
                self._finish(s, {"type": "length", "length": s.params.max_new_tokens})
            elif len(s.prompt) + len(s.output_ids) >= self.max_context:
                self._finish(s, {"type": "length", "length": len(s.output_ids)})
            else:
                keep.append(i)
        return b.select(keep)

    # ---- helpers (caller holds step_lock and/or _cond as noted) ---------------------------
    def _abort_where(self, pred, message: str, error: bool = False) -> int:
        """Abort (`error`: fail) the matching requests. Caller holds `_cond` (and `step_lock`
        unless the scheduler thread is dead)."""
        end = self._fail if error else self._abort
        n = 0
        if self._batch is not None:
            keep = [i for i, s in enumerate(self._batch.seqs) if not pred(s)]
            for s in self._batch.seqs:
                if pred(s):
                    end(s, message)
                    n += 1
            self._batch = self._batch.select(keep)
        for s in [s for s in self._waiting if pred(s)]:
            self._waiting.remove(s)
            end(s, message)
            n += 1
        return n

    def _abort(self, seq: Seq, message: str) -> None:
        self._finish(seq, {"type": "abort", "message": message})

    def _fail(self, seq: Seq, message: str) -> None:
        """The engine could not serve `seq`: it ends with `message` as its error."""
        seq.error = message
        self._finish(seq, {"type": "abort", "message": message})

    def _finish(self, seq: Seq, reason: dict) -> None:
        seq.finish = reason
        seq.weight_version = self.weight_version
        try:
            seq.on_done(seq)
        except Exception:  # a broken callback must not kill the scheduler
            log.exception("on_done callback failed for %s", seq.rid)


def _describe(e: BaseException | None) -> str:
    """One line for an exception: its type and the first line of its message."""
    if e is None:
        return "stopped"
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _eos_ids(model: torch.nn.Module) -> frozenset[int]:
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return frozenset(ids)

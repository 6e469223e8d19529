"""The hf engine: a transformers causal LM behind a step-level dynamic batching scheduler.

One scheduler thread owns the model. Each iteration, under `step_lock`:
  1. admit: waiting requests (up to `max_batch_size` running in all) are prefilled together
     (left-padded) and their KV joins the running batch -- new requests join at step
     boundaries, they never wait for the current batch to drain;
  2. decode: one token for every running row;
  3. finished rows (stop token, max_new_tokens, context limit) leave the batch and are
     answered.
Admission is by priority, SGLang's convention (`priority` on /generate, a larger value first,
as `--enable-priority-scheduling` without `--schedule-low-priority-values-first`; null = 0),
FIFO within a priority; work below priority 0 (held-out evaluation's -1) yields to the rest:
admitted in steps that run no foreground row, beside them only a few every few steps, and a
lane of such rows alone decoded every few steps while foreground rows run (`schedule.py`).
Running requests are never preempted or retracted for priority (SGLang preempts when the gap
reaches `--priority-scheduling-preemption-threshold`, 10).
Control calls (pause/continue/abort/flush/weight load) take `step_lock`, so they act between
steps and never see a half-done step; `step_lock` is fair to them (a waiting control call goes
before the next step), so one acts within the step in progress. Lock order is always
`step_lock` then `_cond`.

Pause modes (SGLang's): `abort` finishes every running and waiting request now with
finish_reason abort (partial output returned); `retract` drops the running rows' KV and puts
them back at the head of the queue with their partial tokens and logprobs kept (after
continue they are re-prefilled from prompt + partial output and carry on); `in_place` just
stops stepping (KV kept). In every mode new requests queue until `resume()`.

Pinned requests (asyncrl's extension, `pin_weight_version` on /generate): only the weights of
that version serve them; before the live weights change, those pinned to the live version move
to a kept copy of the model (`keep_pinned`; what is kept, for how long: pinning.py).

No request takes the scheduler down: a step that raises fails the requests it was serving
(prefill: the ones it admitted; decode: the running batch) with the error, drops their KV, and
the scheduler goes on with the next step. A row whose logits are broken fails alone. Only an
exception outside a step (a bug in the loop itself) stops the scheduler; then every request is
failed, `alive` turns False and the server reports it (`/health`, `/health_generate`: 503).
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

import torch

from asyncrl.engine.hf import checks, pinning, routes, schedule
from asyncrl.engine.hf.batch import KVBatch, Seq, merge, sample
from asyncrl.engine.hf.checks import describe
from asyncrl.engine.hf.lanes import Lane, Lanes, StepLock, eos_ids

log = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "retract", "in_place")


class EngineDeadError(RuntimeError):
    """The scheduler thread is not running: the engine cannot serve (answered with HTTP 503)."""


class HFEngine:
    """`max_pinned_versions`: weight versions besides the live one kept for pinned requests
    (pinning.py); 0: a pinned request fails when its version goes.
    `pinned_linger_s`: each version's lease, from its last pinned request (0: none); `clock`
    times it."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch_size: int = 32,
        seed: int = 0,
        max_pinned_versions: int = 1,
        pinned_linger_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._lanes = Lanes(model.eval(), max_pinned_versions, pinned_linger_s, clock)
        self.device = self._lanes.live.device
        self.max_batch_size = max_batch_size
        cfg = model.config
        self.max_context = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(cfg.vocab_size)
        self.eos_ids = eos_ids(model)
        self.step_lock = StepLock()
        self._cond = threading.Condition(threading.Lock())
        self._waiting: deque[Seq] = deque()
        self._paused = False
        # pause_generation calls by mode, as this engine applied them (/server_info reports them)
        self.pauses: Counter[str] = Counter()
        self._stopping = False
        self._seed_rng = random.Random(seed)
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self.error: BaseException | None = None
        self._steps = 0  # steps begun (`schedule` shares steps with background work by it)
        self.step_failures = 0  # steps that raised (their requests failed, the engine went on)
        self.last_step_ok = True

    @property
    def model(self) -> torch.nn.Module:
        """The live weights (what weight updates load into)."""
        return self._lanes.live.model

    @property
    def max_pinned_versions(self) -> int:
        return self._lanes.max_kept

    @property
    def pinned_linger_s(self) -> float:
        return self._lanes.linger_s

    @property
    def weight_version(self) -> str:
        return self._lanes.live.version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        """The live weights are `version` (once loaded; `keep_pinned` before they change)."""
        self._lanes.live.version, self._lanes.pinnable = version, True

    def set_weight_version(self, version: str) -> None:
        """Relabel the live weights (SGLang's /update_weight_version): the requests pinned to
        the old label are kept on it first."""
        with self.step_lock:
            self.keep_pinned()
            self.weight_version = version

    def kept_versions(self) -> list[str]:
        with self._cond:
            return list(self._lanes.kept)

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
        """Raise ValueError if the engine cannot serve `seq` (tokens, length, pinned version),
        EngineDeadError if the scheduler is not running."""
        self._check_prompt(seq)
        with self._cond:
            self._check_pin(seq)

    def _check_prompt(self, seq: Seq) -> None:
        if self.error is not None:
            raise EngineDeadError(f"engine scheduler died: {describe(self.error)}")
        checks.check_prompt(seq, self.vocab_size, self.max_context)
        routes.check(self._lanes.live.tap, seq)

    def _check_pin(self, seq: Seq) -> None:
        """Caller holds `_cond`: the lanes as `keep_pinned` leaves them, not half-way through
        its copy of a version (it holds `_cond` throughout)."""
        if seq.pin is not None and self._lanes.route(seq) is None:
            raise ValueError(f"pin_weight_version {seq.pin} is not served: {self._lanes}")

    def submit(self, *seqs: Seq) -> None:
        """Queue requests, all or none (each is checked first); each is answered through
        `seq.on_done` on the scheduler thread. Queued together, they wake the scheduler once:
        one HTTP request's samples are admitted in the same step (one prefill)."""
        for seq in seqs:  # outside the lock: a scan of every prompt token
            self._check_prompt(seq)
        with self._cond:
            for seq in seqs:
                self._check_pin(seq)
            for seq in seqs:
                checks.seed_generator(seq, self._seed_rng)
                self._lanes.touch(seq.pin)
                if seq.params.max_new_tokens == 0:
                    self._finish(seq, {"type": "length", "length": 0})
                else:
                    self._waiting.append(seq)
            self._cond.notify_all()

    def pause(self, mode: str) -> None:
        """Stop serving the live weights (their requests as `mode` says); kept versions, which
        no update touches, go on serving their pinned requests."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; expected one of {PAUSE_MODES}")
        with self.step_lock:
            self.keep_pinned()  # a pause precedes a weight update
            with self._cond:
                self._paused = True
                self.pauses[mode] += 1
                live, kept = self._lanes.live, self._lanes.kept
                why = "aborted by pause_generation(abort)"
                if mode == "abort":
                    self._abort_where(lambda s: s.pin not in kept, why)
                elif mode == "retract" and live.batch is not None:
                    self._waiting.extendleft(reversed(live.batch.seqs))
                    live.batch = None

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def abort(self, rid: str | None = None) -> int:
        """Abort one request by rid (None: all). Returns how many were aborted."""
        with self.step_lock, self._cond:
            self._cond.notify_all()  # freed slots: a request waiting for one may run now
            return self._abort_where(lambda s: rid is None or s.rid == rid, "aborted by request")

    def keep_pinned(self) -> None:
        """Before the live weights change: the requests pinned to the live version, running
        (with their KV) or waiting, go to a kept copy of the model that serves them to the end
        (dropped then); no new request is pinned to the live weights until a version is set.
        A version leased (lanes.py) is kept the same way, with no request. Past
        `max_pinned_versions` a kept version goes (`Lanes.evictee`; its requests fail). Caller
        holds `step_lock` (so no step is half done)."""
        with self._cond:
            fail = functools.partial(self._abort_where, error=True)
            pinning.keep_pinned(self._lanes, self._waiting, fail)

    def num_requests(self) -> int:
        with self._cond:
            return sum(len(lane.running) for lane in self._lanes.all()) + len(self._waiting)

    def load(self) -> dict[str, int]:
        """SGLang's `/get_load` numbers, read between steps: requests running or waiting, those
        waiting, and the tokens (prompt + output) the running requests hold in KV."""
        with self.step_lock, self._cond:
            running = [s for lane in self._lanes.all() for s in lane.running]
            return {
                "num_reqs": len(running) + len(self._waiting),
                "num_waiting_reqs": len(self._waiting),
                "num_tokens": sum(len(s.prompt) + len(s.output_ids) for s in running),
            }

    def flush_cache(self) -> bool:
        """There is no prefix cache to drop; refuse (False) while any request holds KV of the
        live weights.

        As SGLang: running requests -> refused (in_place pause keeps them running); after a
        retract the queued requests hold no KV, so a paused engine may flush. Unpaused waiting
        requests are about to run, so they count as running. Kept versions' requests do not
        count: their KV belongs to weights no update touches.
        """
        with self.step_lock, self._cond:
            live_waiting = any(s.pin not in self._lanes.kept for s in self._waiting)
            return self._lanes.live.batch is None and (self._paused or not live_waiting)

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
                self._abort_where(lambda s: True, f"engine scheduler died: {describe(e)}", True)

    def _step(self) -> None:
        """Admit waiting requests (prefill), then decode one token for every lane's running
        batch (a paused engine: the kept lanes only). Each prefill or decode that raises fails
        only its own requests; the scheduler carries on."""
        with self._cond:
            lanes = self._lanes.all()
            stepping = lanes[1:] if self._paused else lanes  # the live weights wait; kept go on
            running = [s for lane in lanes for s in lane.running]
            self._steps += 1
            admit = self._take_waiting(running, schedule.busy(stepping))
        ok = True
        with torch.inference_mode():
            for lane, seqs in self._by_lane(admit):
                try:
                    batch, logits = lane.prefill(seqs)
                    lane.batch = merge(lane.batch, self._sample_and_retire(batch, logits, lane))
                except Exception as e:  # the running batch is untouched: only `seqs` fail
                    ok = self._fail_step(seqs, "prefill", e)
            for lane in schedule.due_lanes(stepping, self._steps):  # after the prefills
                if lane.batch is None:
                    continue
                try:
                    lane.batch = self._sample_and_retire(lane.batch, lane.decode(), lane)
                except Exception as e:  # the batch's KV may be half updated: drop it whole
                    batch, lane.batch = lane.batch, None
                    ok = self._fail_step(batch.seqs, "decode", e)
        if self._lanes.kept:
            with self._cond:
                self._lanes.drop_idle(list(self._waiting))
        self.last_step_ok = ok

    def _by_lane(self, seqs: list[Seq]) -> list[tuple[Lane, list[Seq]]]:
        """`seqs` grouped by the lane that serves each; one whose pinned version is no longer
        served fails."""
        out: dict[int, tuple[Lane, list[Seq]]] = {}
        for s in seqs:
            lane = self._lanes.route(s)
            if lane is None:
                self._fail(s, f"pin_weight_version {s.pin} no longer served: {self._lanes}")
            else:
                out.setdefault(id(lane), (lane, []))[1].append(s)
        return list(out.values())

    def _take_waiting(self, running: list[Seq], busy: bool) -> list[Seq]:
        """The waiting requests `schedule.admit` picks to join `running` (`busy`: a foreground
        row runs), removed from the queue; while paused, only those a kept version serves.
        Caller holds `_cond`."""
        if not self._waiting:
            return []
        admit, rest = schedule.take(self._waiting, self._lanes, self._paused, running,
                                    self.max_batch_size, busy, self._steps)  # fmt: skip
        self._waiting = deque(rest)
        return admit

    def _fail_step(self, seqs: list[Seq], what: str, e: Exception) -> bool:
        log.exception("hf engine: %s step failed; failing its %d request(s)", what, len(seqs))
        self.step_failures += 1
        for s in seqs:
            if s.finish is None:  # some may have finished within the step before it raised
                self._fail(s, f"engine {what} step failed: {describe(e)}")
        return False

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._stopping and not self._has_work():
                self._cond.wait()
            return not self._stopping

    def _has_work(self) -> bool:
        """Caller holds `_cond`."""
        return schedule.has_work(self._lanes, self._waiting, self._paused, self.max_batch_size)

    def _sample_and_retire(self, b: KVBatch, logits: torch.Tensor, lane: Lane) -> KVBatch | None:
        tokens, lps, errors = sample(logits, b.seqs)
        b.last = torch.tensor(tokens, device=lane.device)
        keep = []
        for i, (s, tok, lp, err) in enumerate(zip(b.seqs, tokens, lps, errors)):
            if err is not None:
                self._fail(s, err)
                continue
            s.output_ids.append(tok)
            s.logprobs.append(lp)
            s.token_versions.append(lane.version)
            reason = checks.finish_reason(s, tok, self.eos_ids, self.max_context)
            if reason is None:
                keep.append(i)
            else:
                self._finish(s, reason)
        return b.select(keep)

    # ---- helpers (caller holds step_lock and/or _cond as noted) ---------------------------
    def _abort_where(self, pred, message: str, error: bool = False) -> int:
        """Abort (`error`: fail) the matching requests, running in any lane or waiting. Caller
        holds `_cond` (and `step_lock` unless the scheduler thread is dead)."""
        end = self._fail if error else self._abort
        n = 0
        for lane in self._lanes.all():
            keep = [i for i, s in enumerate(lane.running) if not pred(s)]
            for s in lane.running:
                if pred(s):
                    end(s, message)
                    n += 1
            lane.batch = lane.batch.select(keep) if lane.batch is not None else None
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
        seq.weight_version = self.weight_version if seq.pin is None else seq.pin
        self._lanes.touch(seq.pin)
        try:
            seq.on_done(seq)
        except Exception:  # a broken callback must not kill the scheduler
            log.exception("on_done callback failed for %s", seq.rid)

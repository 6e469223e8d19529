"""Rollout workers as plain child processes of the driver (`rollout.worker_pool: process`),
behind the dispatcher's `WorkerPool` interface; no Ray.

Why: a rollout worker is an I/O-bound client of the engines. As a Ray actor it costs Ray's
daemons (seven processes that each import Ray) before the first prompt; as a thread of the
driver (`local_pool.py`) it shares the driver's interpreter lock with the learner and slows the
loop. A child process of its own (`process_worker.py`: it imports only the rollout stack) has
neither cost. The schema's docstring of `worker_pool` gives the measured figures.

The channel is a pair of pipes per worker carrying length-framed msgpack (no pickle): the
worker's sub-config once, then submissions out and per-submission answers back. A reader
thread per worker turns answers into futures, so `poll` waits on them and on `wake` at once.

Semantics kept from the Ray pool: a worker that cannot be built raises
`PermanentRolloutError` at start with the real error (a replacement that cannot be built
answers every prompt with a permanent failure); a worker process that dies is replaced (counted
in `restarts`) and each submission it held comes back from `poll` as an exception, so the
dispatcher re-issues its prompts; `MAX_CONSECUTIVE_DEATHS` failures of one worker in a row with
no answer in between end the run. The workers end with the driver, even one killed by
`kill -9` (the EOF of their command pipe, `process_worker.py`).
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from asyncrl.data.prompts import PromptItem
from asyncrl.rollout.process_worker import (
    items_to_wire,
    pack,
    results_from_wire,
    settings_to_wire,
    unpack,
)
from asyncrl.rollout.settings import (
    PermanentRolloutError,
    PromptResult,
    RolloutSettings,
    Wakeup,
    given_up,
    start_failure,
)


class RolloutWorkerDied(RuntimeError):
    """A worker's process ended while it held the submission (the prompts are re-issued)."""


class RolloutWorkerFailed(RuntimeError):
    """A submission raised in the worker (not one prompt's failure: its own code's)."""


def _exit_status(code: int | None) -> str:
    if code is None:
        return "its pipe closed"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


class _Child:
    """One worker process, its two pipes, and the reader thread that settles its submissions."""

    def __init__(self, index: int, settings: RolloutSettings, cpus: list[int]) -> None:
        self.index = index
        cmd_read, cmd_write = os.pipe()
        answer_read, answer_write = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "asyncrl.rollout.process_worker",
                 str(cmd_read), str(answer_write)],
                pass_fds=(cmd_read, answer_write), stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except BaseException:
            for fd in (cmd_write, answer_read):
                os.close(fd)
            raise
        finally:  # the child's ends: held here, they would hide its exit (no EOF)
            os.close(cmd_read)
            os.close(answer_write)
        self.commands = Connection(cmd_write, readable=False)
        self.answers = Connection(answer_read, writable=False)
        self._send_lock = threading.Lock()
        self.pending: dict[int, cf.Future] = {}  # submission id -> its outcome
        self._lock = threading.Lock()  # `pending` and `ended`, shared with the reader
        self.ended: str = ""  # why the process ended, once its pipe has
        self.started: cf.Future[str] = cf.Future()  # '' or why the worker could not start
        self._ids = itertools.count()
        try:  # `cpus`: a replacement spawned once the driver pinned itself is not confined
            self.send({"parent": os.getpid(), "cpus": cpus, **settings_to_wire(settings)})
        except OSError:  # it died at once: the reader finds out why (its exit status)
            pass
        self.reader = threading.Thread(
            target=self._read, name=f"asyncrl-rollout-proc-{index}", daemon=True
        )
        self.reader.start()

    def send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            self.commands.send_bytes(pack(message))

    def submit(self, items: list[PromptItem]) -> cf.Future:
        done: cf.Future = cf.Future()
        ident = next(self._ids)
        try:
            frame = pack({"id": ident, "items": items_to_wire(items)})
        except TypeError as e:  # prompt metadata msgpack cannot carry: no retry helps
            done.set_exception(PermanentRolloutError(f"prompt {items[0].key}: {e}"))
            return done
        with self._lock:
            if self.ended:
                done.set_exception(RolloutWorkerDied(self.ended))
                return done
            self.pending[ident] = done
        try:
            with self._send_lock:
                self.commands.send_bytes(frame)
        except OSError:  # the process is gone: its reader settles the submission
            pass
        return done

    def _read(self) -> None:
        """A thread: answers into their futures until the pipe ends, then fail what is left."""
        while True:
            try:
                message = unpack(self.answers.recv_bytes())
            except (EOFError, OSError, ValueError):
                self.answers.close()
                break
            if "started" in message:
                self.started.set_result(str(message["started"]))
                continue
            with self._lock:
                done = self.pending.pop(message.get("id"), None)
            if done is None:
                continue
            try:
                if "error" in message:
                    raise RolloutWorkerFailed(message["error"])
                done.set_result(results_from_wire(message["results"]))
            except Exception as e:  # noqa: BLE001 - its error, or an answer not understood
                done.set_exception(e)
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        why = f"rollout worker {self.index}'s process (pid {self.proc.pid}) ended: "
        with self._lock:
            self.ended = why + _exit_status(code)
            left, self.pending = list(self.pending.values()), {}
        if not self.started.done():
            self.started.set_result(self.ended)
        for done in left:
            done.set_exception(RolloutWorkerDied(self.ended))

    def close(self) -> None:
        """Ask the worker to end (it closes its connections, then exits)."""
        try:
            self.send({"close": True})
        except OSError:
            pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def release(self, timeout: float) -> None:
        """Once its process has ended: its command pipe closed, the reader's end waited for
        (the reader closes the answer pipe)."""
        self.commands.close()
        self.reader.join(timeout)


class ProcessWorkerPool:
    """`num_workers` rollout workers, each a child process; worker i gets `settings_for(i)`
    (a replacement too)."""

    def __init__(self, settings_for: Callable[[int], RolloutSettings], num_workers: int) -> None:
        self._settings_for = settings_for
        # The cores the workers may use: the driver's now, before it pins itself to the
        # learner's (a child inherits its creator's affinity; workers are never pinned).
        self._cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.children: list[_Child] = []
        self.generation = [0] * num_workers
        self.deaths = [0] * num_workers  # in a row, per worker: reset by any answer
        self.refs: dict[cf.Future, tuple[int, int]] = {}  # submission -> (worker, generation)
        self.restarts = 0
        self._wakeup = Wakeup()
        try:
            for index in range(num_workers):
                self.children.append(_Child(index, settings_for(index), self._cpus))
            errors = [child.started.result() for child in self.children]
        except BaseException:
            self.close()
            raise
        failure = start_failure(errors)
        if failure is not None:
            self.close()
            raise failure

    def size(self) -> int:
        return len(self.children)

    def submit(self, actor: int, items: list[PromptItem]) -> cf.Future:
        ref = self.children[actor].submit(items)
        self.refs[ref] = (actor, self.generation[actor])
        return ref

    def wake(self) -> None:
        self._wakeup.wake()

    def poll(self, timeout: float) -> list[tuple[int, Any, list[PromptResult] | Exception]]:
        """Waits (never spins) until a submission ends, `wake`, or the timeout."""
        self._wakeup.wait(self.refs, timeout)
        out = []
        for ref in [ref for ref in self.refs if ref.done()]:
            actor, gen = self.refs.pop(ref)
            try:
                outcome: Any = ref.result()
                self.deaths[actor] = 0
            except PermanentRolloutError as e:
                outcome = e
            except Exception as e:  # noqa: BLE001 - a death, or the worker's own error
                if gen == self.generation[actor]:  # the first of its generation's to say so
                    self.deaths[actor] += 1
                    if isinstance(e, RolloutWorkerDied):
                        self._replace(actor)
                how = "died" if isinstance(e, RolloutWorkerDied) else "failed"
                outcome = given_up(actor, self.deaths[actor], e, how=how)
            out.append((actor, ref, outcome))
        return out

    def _replace(self, actor: int) -> None:
        """A fresh process in a dead one's place; its start is not waited for (submissions
        queue in its pipe meanwhile), as Ray's actors are not."""
        old = self.children[actor]
        old.kill()
        old.release(timeout=0)
        self.children[actor] = _Child(actor, self._settings_for(actor), self._cpus)
        self.generation[actor] += 1
        self.restarts += 1

    def pids(self) -> list[int]:
        return [child.proc.pid for child in self.children]

    def metrics(self) -> dict[str, float]:
        """The pool's own figures: its live worker processes (children of the driver) and the
        replacements so far."""
        alive = sum(child.proc.poll() is None for child in self.children)
        return {
            "rollout/worker_processes": float(alive),
            "rollout/worker_restarts": float(self.restarts),
        }

    def close(self, grace_s: float = 2.0) -> None:
        """End the workers: each closes its connections and exits (at most `grace_s` in all),
        then any still running is killed."""
        for child in self.children:
            child.close()
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.proc.wait()
            child.release(timeout=grace_s)
        self.children = []

"""Rollout workers as Ray actors, behind the dispatcher's small `WorkerPool` interface.

A worker that dies (its process killed, an unhandled error) is replaced by a fresh one with the
same settings; every submission it held comes back from `poll` as an exception so the
dispatcher re-issues those prompts. Ray starts locally unless `RAY_ADDRESS` names a cluster.

A worker that cannot be built (a bad reward function, a tokenizer that does not load, no
receiver to connect to) is not a process to replace: the pool raises `PermanentRolloutError`
with the real error at start, and a replacement that fails the same way answers every prompt
with a permanent result. `MAX_CONSECUTIVE_DEATHS` deaths of one worker with no answer in
between end the run the same way, instead of respawning forever.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Callable
from typing import Any

from asyncrl.data.prompts import PromptItem
from asyncrl.net import init_ray
from asyncrl.rollout.settings import (
    PromptResult,
    RolloutSettings,
    Wakeup,
    given_up,
    start_failure,
)
from asyncrl.rollout.worker import RolloutWorker


class _RayRolloutWorker:
    """The Ray-side shell: one RolloutWorker per Ray actor process, called concurrently. Its
    construction never raises: a failure is kept and reported (`start_error`, and a permanent
    result for every prompt), since Ray would only restart an actor that raised."""

    def __init__(self, settings: RolloutSettings) -> None:
        self.worker: RolloutWorker | None = None
        self.start_error = ""
        try:
            self.worker = RolloutWorker(settings)
        except Exception as e:  # noqa: BLE001 - reported whole by start_error / run_prompts
            self.start_error = f"{type(e).__name__}: {e}"

    def started(self) -> str:
        """'' once the worker is built, else why it could not be."""
        return self.start_error

    async def run_prompts(self, items: list[PromptItem]) -> list[PromptResult]:
        if self.worker is None:
            error = f"rollout worker failed to start: {self.start_error}"
            return [PromptResult(it.key, ok=False, error=error, permanent=True) for it in items]
        return await self.worker.run_prompts(items)

    async def close(self) -> None:
        """Close the worker's connections before its actor is killed (`RayWorkerPool.close`)."""
        if self.worker is not None:
            await self.worker.aclose()

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class RayWorkerPool:
    """`num_workers` rollout workers as Ray actors; worker i gets `settings_for(i)` and the Ray
    options `options_for(i)` (where it runs: multi-node, its engine's placement-group bundle;
    None: wherever Ray likes). `address`: the Ray cluster (None: `init_ray`'s default)."""

    def __init__(
        self,
        settings_for: Callable[[int], RolloutSettings],
        num_workers: int,
        options_for: Callable[[int], dict[str, Any]] | None = None,
        address: str | None = None,
    ) -> None:
        import ray

        init_ray(address)
        self._ray = ray
        self._cls = ray.remote(num_cpus=0, max_concurrency=1000)(_RayRolloutWorker)
        self._settings_for = settings_for
        self._options_for = options_for or (lambda index: {})
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), False)
        self.workers = [self._spawn(i) for i in range(num_workers)]
        self.generation = [0] * num_workers
        self.deaths = [0] * num_workers  # in a row, per worker: reset by any answer
        # ref -> (actor, generation, its completion as a future: `poll` waits on the refs and
        # on `wake` at once)
        self.refs: dict[Any, tuple[int, int, cf.Future]] = {}
        self._wakeup = Wakeup()
        self.restarts = 0
        self._check_started()

    def _check_started(self) -> None:
        """Wait until every worker is built; PermanentRolloutError (the workers stopped) with
        the first failure's message in full otherwise."""
        try:
            errors = self._ray.get([w.started.remote() for w in self.workers])
        except Exception as e:  # the actor process itself died while starting
            errors = [f"{type(e).__name__}: {e}"]
        failure = start_failure(errors)
        if failure is not None:
            self.close()
            raise failure

    def _spawn(self, index: int) -> Any:
        # A replacement goes where its predecessor was placed (its engine's node). Without a
        # placement a worker stays on the driver's node: it reaches loopback engines and the
        # loopback receiver even when RAY_ADDRESS joined a cluster of several nodes.
        options = self._options_for(index) or {"scheduling_strategy": self._here}
        return self._cls.options(name=None, **options).remote(self._settings_for(index))

    def size(self) -> int:
        return len(self.workers)

    def submit(self, actor: int, items: list[PromptItem]) -> Any:
        ref = self.workers[actor].run_prompts.remote(items)
        self.refs[ref] = (actor, self.generation[actor], ref.future())
        return ref

    def wake(self) -> None:
        self._wakeup.wake()

    def poll(self, timeout: float) -> list[tuple[int, Any, list[PromptResult] | Exception]]:
        """Waits (never spins) until a submission ends, `wake`, or the timeout."""
        self._wakeup.wait([done for _, _, done in self.refs.values()], timeout)
        out = []
        for ref in [ref for ref, (_, _, done) in self.refs.items() if done.done()]:
            actor, gen, _ = self.refs.pop(ref)
            try:
                outcome: Any = self._ray.get(ref)
                self.deaths[actor] = 0
            except Exception as e:  # noqa: BLE001 - RayActorError and task errors alike
                if gen == self.generation[actor]:
                    self.deaths[actor] += 1
                    self._replace(actor)
                outcome = given_up(actor, self.deaths[actor], e, how="died")
            out.append((actor, ref, outcome))
        return out

    def _replace(self, actor: int) -> None:
        try:
            self._ray.kill(self.workers[actor], no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
        self.workers[actor] = self._spawn(actor)
        self.generation[actor] += 1
        self.restarts += 1

    def pids(self) -> list[int]:
        return self._ray.get([a.pid.remote() for a in self.workers])

    def node_ids(self) -> list[str]:
        """The Ray node id each worker runs on."""
        return self._ray.get([a.node_id.remote() for a in self.workers])

    def close(self, grace_s: float = 2.0) -> None:
        """End the workers: each closes its connections first (at most `grace_s` in all: a
        worker whose send is blocked is killed anyway), then its actor is killed."""
        try:
            if closing := [actor.close.remote() for actor in self.workers]:
                self._ray.wait(closing, num_returns=len(closing), timeout=grace_s)
        except Exception:  # noqa: BLE001 - a dead actor, Ray shutting down: kill what is left
            pass
        for actor in self.workers:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.workers = []

"""The engine fleet: launch, weight-update group, weight sync, self-healing.

`hf_infer` engines are asyncrl's own server processes (one per engine, loopback); `sglang`
engines are SGLang servers (a router in front of several). Either way the fleet is driven
through the same SGLang-protocol client. Multi-node (`cluster.address`), each engine is a Ray
actor placed on a node that starts the same server there, reached at that node's address
(`engine/placement.py`); the update group then meets on this driver node's address. An engine that cannot generate is relaunched -- its
process died, or it is alive but failed `health_failures` health checks (/health_generate) in a
row: a dead scheduler, a hung process -- then the update group is formed again with every
engine, and the current weights are pushed before it serves again. The health checks run in
the background on the control loop, so `heal` never waits on an engine that is fine.

With `api_key`, every engine requires it (`Authorization: Bearer`, as SGLang's `--api-key`);
the fleet's clients send it, and so must the rollout workers' (`EngineFleet.api_key`).

The weight groups and syncs are `FleetWeights`' (`engine/fleet_weights.py`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncrl.config.schema import ClusterConfig, WeightSyncConfig, WorkerConfig
from asyncrl.engine.client import EngineClient
from asyncrl.engine.fleet_weights import FleetWeights, weight_senders
from asyncrl.engine.health import HealthMonitor
from asyncrl.engine.launchers import make_launcher
from asyncrl.engine.process import ServerHandle
from asyncrl.net import AsyncRunner
from asyncrl.threads import ThreadShare
from asyncrl.weights.lora_native import NativeLora, NativeLoraSync
from asyncrl.weights.sync import WeightSource

log = logging.getLogger(__name__)


class EngineFleet(FleetWeights):
    """The engines of `actor_infer`, their clients, and the weight sender that feeds them.

    `api_key`: the shared secret every engine requires and every client sends (None: none).
    `health_interval_s`, `health_timeout_s`, `health_failures`: an engine whose process lives
    is relaunched after `health_failures` background health checks in a row failed (no 200
    from /health_generate within `health_timeout_s`); a check round starts at most every
    `health_interval_s`. `dedicated_eval` (`logging.eval_engine: dedicated`): the last engine
    serves evaluation alone (`eval_clients`); rollout workers are never routed to it
    (`urls_for_worker`); it has a weight group of its own, which a sync reaches only when it
    says so (`eval_engine`), while health checks and healing reach it like any other."""

    def __init__(
        self,
        infer: WorkerConfig,
        weight_sync: WeightSyncConfig,
        pause_mode: str,
        model_dir: Path,
        output_dir: Path,
        *,
        seed: int,
        request_timeout_s: float,
        runner: AsyncRunner,
        api_key: str | None = None,
        eval_priority: int | None = None,
        cluster: ClusterConfig | None = None,
        health_interval_s: float = 10.0,
        health_timeout_s: float = 30.0,
        health_failures: int = 2,
        dedicated_eval: bool = False,
        lora: NativeLora | None = None,
    ) -> None:
        self.infer, self.ws = infer, weight_sync
        # "none": no pause; the engines hold the buckets and load them at the last one
        self.pause_mode = None if pause_mode == "none" else pause_mode
        self.request_timeout_s, self.runner = request_timeout_s, runner
        self.health = HealthMonitor(runner, health_interval_s, health_timeout_s, health_failures)
        self.handles: list[ServerHandle] = []
        self.clients: list[EngineClient] = []
        self.counters: Counter[str] = Counter()
        self.last_sync: dict[str, float] = {}
        self.engine_tallies: dict[str, float] = {}  # what the engines report (`_engine_tallies`)
        # The version of the last sync every engine completed (None: none yet); read by the
        # dispatcher's thread, which stamps it on the prompts it hands out.
        self.synced_version: int | None = None
        self.backend = "gloo"  # of the weight-update group; resolved by `_init_group`
        self.multinode = cluster is not None and bool(cluster.address.strip())
        self.launcher = make_launcher(
            infer, model_dir, output_dir / "engine_logs", seed, api_key, eval_priority, cluster,
            lora,
        )  # fmt: skip
        # lora_sync native: syncs load adapters by name (no broadcast); clients name them
        self.native = NativeLoraSync(lora.lora_dir, weight_sync.timeout_s) if lora else None
        self.api_key = self.launcher.api_key  # what rollout workers' clients must send
        self.num_engines = self.launcher.num_engines
        # The evaluation engine is the last one: rollout keeps engines 0..n-2 (and their order).
        self.eval_index = _eval_index(self.num_engines, dedicated_eval)
        self.sender, self.eval_sender = weight_senders(infer, weight_sync, dedicated_eval)

    # -- processes ---------------------------------------------------------------------------
    def spawn(self, threads: Sequence[ThreadShare] = ()) -> None:
        """Start the engine processes without waiting for them, where the launcher can
        (`spawn`/`wait_ready`: hf_infer), so that their models load while the caller goes on
        (the run builds its learner meanwhile); `start` then waits for them. Other launchers
        start nothing here: their `launch` returns a ready engine, and an SGLang engine sizes
        its memory pool by what is free when it starts, so it still starts after the learner.
        `threads`: each local hf engine's share of the run's thread budget. Call it from the
        thread that calls `start`: an engine dies with the thread that started it
        (engine/process.py), and the run's main thread outlives its engines."""
        if threads and hasattr(self.launcher, "threads"):
            self.launcher.threads = threads  # kept: a relaunched engine gets the same share
        spawn = getattr(self.launcher, "spawn", None)
        if spawn is not None and not self.handles:
            for i in range(self.num_engines):  # one by one: `stop` stops those before a failure
                self.handles.append(spawn(i))

    def start(
        self,
        source: WeightSource,
        meanwhile: Callable[[], Any] | None = None,
        threads: Sequence[ThreadShare] = (),
    ) -> Any:
        """Launch every engine (unless `spawn` did), form the update group and push `source`'s
        weights; returns what `meanwhile` returned. `meanwhile` runs while the engines load,
        once their URLs are known (the run starts its rollout workers there: they need the
        URLs, not the engines). `threads`: as `spawn`'s.

        A launcher with `spawn`/`wait_ready` (hf_infer) starts every engine before waiting
        for any, so the models load at once and beside `meanwhile`; the others' `launch`
        returns a ready engine, and `meanwhile` runs after the last one."""
        self.spawn(threads)
        if not self.handles:  # a launcher without `spawn`: each `launch` waits for its engine
            for i in range(self.num_engines):
                self.handles.append(self.launcher.launch(i))
        done = meanwhile() if meanwhile is not None else None
        if hasattr(self.launcher, "spawn"):  # spawned: wait for each now
            self.handles = [self.launcher.wait_ready(h) for h in self.handles]
        self.clients = [self._client(h.url) for h in self.handles]
        self._init_group(source.sync_device)
        self.sync(source)
        return done

    def _client(self, url: str) -> EngineClient:
        async def make() -> EngineClient:  # aiohttp sessions belong to the control loop
            return EngineClient(
                url, timeout=self.request_timeout_s, api_key=self.api_key,
                lora=self.native is not None,
            )  # fmt: skip

        return self.runner.run(make())

    def worker_options(self, index: int) -> dict[str, Any]:
        """Ray options of rollout worker `index`: multi-node, it runs beside its first engine
        (in that engine's bundle, so workers spread over the engines' nodes); else none."""
        options = getattr(self.launcher, "actor_options", None)
        return options(index % len(self._rollout_engines())) if options else {}

    def urls_for_worker(self, index: int) -> list[str]:
        """Every rollout worker may use every rollout engine (not a dedicated evaluation
        engine); workers start on different ones. With a router (sglang, several engines)
        every worker generates through the router, which is given the rollout engines only."""
        engines = [self.handles[i].url for i in self._rollout_engines()]
        urls = self.launcher.actor_urls(engines)
        shift = index % len(urls)
        return urls[shift:] + urls[:shift]

    def routed(self) -> bool:
        """Whether `urls_for_worker` is a router (its /generate takes no batch: rollout
        workers' clients are made with `router=True`)."""
        return self.launcher.routes(len(self._rollout_engines()))

    def eval_clients(self) -> list[EngineClient]:
        """The clients evaluation sends its requests through: the dedicated evaluation
        engine's alone, else every engine's (shared with rollout, at evaluation's priority)."""
        if self.eval_index is None:
            return list(self.clients)
        return [self.clients[self.eval_index]]

    def heal(self, source: WeightSource) -> bool:
        """Relaunch every engine that cannot generate (its process died, or its background
        health checks failed) and bring the fleet to `source`'s weights; True if any engine was
        relaunched. Cheap when all is well: a process poll and the last check round's answers."""
        dead = [i for i, h in enumerate(self.handles) if h.proc.poll() is not None]
        sick = [i for i in self.health.poll(self.handles, self.clients) if i not in dead]
        if not dead and not sick:
            return False
        for i in sorted(dead + sick):
            old = self.handles[i]
            old.kill()  # an engine that cannot generate has nothing worth a graceful stop
            # Same port, so workers keep their URLs; their failed prompts are re-issued.
            port = int(old.url.rsplit(":", 1)[1])
            self.handles[i] = self.launcher.launch(i, port)
            self.health.forget(i)
            self.counters["engine_restarts"] += 1
            why = "died" if i in dead else "failed its health checks (cannot generate)"
            print(f"asyncrl: engine {i} {why}; relaunched at {self.handles[i].url}")
        self._init_group(source.sync_device)
        self.sync(source)
        return True

    def stop(self) -> None:
        self.health.close()
        if self.native is not None:  # unloads still waiting: moot, the engines stop
            self.runner.run(self.native.close(), timeout=10)
        for sender in (self.sender, self.eval_sender):
            try:
                if sender is not None:
                    self.runner.run(sender.close(), timeout=30)
            except Exception:  # noqa: BLE001 - engines may be gone already
                pass
        for client in self.clients:
            self.runner.run(client.close(), timeout=10)
        for handle in self.handles:
            handle.stop()
        self.launcher.close()

    def metrics(self) -> dict[str, float]:
        return {f"engines/{k}": float(v) for k, v in self.counters.items()} | self.engine_tallies


def _eval_index(num_engines: int, dedicated_eval: bool) -> int | None:
    """The dedicated evaluation engine's index (the last engine), or None."""
    if dedicated_eval and num_engines < 2:  # `config validate` refuses it first
        raise ValueError(
            f"logging.eval_engine: dedicated needs at least 2 engines, actor_infer has "
            f"{num_engines}"
        )
    return num_engines - 1 if dedicated_eval else None

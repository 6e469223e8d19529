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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from asyncrl.config.schema import ClusterConfig, WeightSyncConfig, WorkerConfig
from asyncrl.device import resolve_backend, select_device, torch_dtype
from asyncrl.engine.client import EngineClient
from asyncrl.engine.health import HealthMonitor
from asyncrl.engine.launchers import make_launcher
from asyncrl.engine.process import ServerHandle
from asyncrl.engine.tallies import read_tallies
from asyncrl.net import AsyncRunner, is_loopback, node_ip
from asyncrl.threads import ThreadShare
from asyncrl.weights.lora_native import NativeLora, NativeLoraSync
from asyncrl.weights.sync import SyncStats, WeightSender, WeightSource

log = logging.getLogger(__name__)

#: The weight group of a dedicated evaluation engine (`logging.eval_engine: dedicated`).
EVAL_GROUP = "asyncrl_weights_eval"


class EngineFleet:
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
        self.sender, self.eval_sender = _senders(infer, weight_sync, dedicated_eval)

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

    def _init_group(self, device: Any) -> None:
        """Form every weight group, rank 0 on `device`: the learner's `sync_device`, read
        at each group init and sync (the fleet and its senders are made before the learner,
        so nothing at their construction could know it)."""
        ws = self.ws
        self.backend = resolve_backend(ws.backend, self.launcher.device)  # auto: nccl|hccl|gloo
        for k, (sender, clients) in enumerate(self._groups(eval_engine=True)):
            tp_sizes = [self.launcher.tp_size] * len(clients)  # engine i joins at 1 + i*tp
            port = ws.master_port + k if ws.master_port else None  # the evaluation's: next one
            args = (clients, self.master_address(), port, self.backend)
            self.runner.run(
                sender.init_group(*args, ws.timeout_s, tp_sizes=tp_sizes, device=device),
                timeout=ws.timeout_s + 30,
            )

    def _groups(self, eval_engine: bool) -> list[tuple[WeightSender, list[EngineClient]]]:
        """The weight groups a sync reaches, each with its engines' clients: one of every
        engine; with a dedicated evaluation engine, the rollout engines' and (`eval_engine`)
        the evaluation engine's."""
        if self.eval_sender is None:
            return [(self.sender, list(self.clients))]
        rollout = [self.clients[i] for i in self._rollout_engines()]
        evaluation = [(self.eval_sender, [self.clients[self.eval_index]])] if eval_engine else []
        return [(self.sender, rollout), *evaluation]

    def master_address(self) -> str:
        """Where the update group meets: the learner's (this driver's) node. Multi-node, a
        loopback `weight_sync.master_address` becomes the node's address from Ray: the
        engines on other nodes must reach its TCPStore."""
        address = self.ws.master_address
        return node_ip() if self.multinode and is_loopback(address) else address

    def worker_options(self, index: int) -> dict[str, Any]:
        """Ray options of rollout worker `index`: multi-node, it runs beside its first engine
        (in that engine's bundle, so workers spread over the engines' nodes); else none."""
        options = getattr(self.launcher, "actor_options", None)
        return options(index % len(self._rollout_engines())) if options else {}

    def _rollout_engines(self) -> list[int]:
        """The engines rollout generates on: all of them, or all but the evaluation engine."""
        return [i for i in range(self.num_engines) if i != self.eval_index]

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

    # -- weights -----------------------------------------------------------------------------
    def _served_dtype(self) -> Any:
        """The engines' dtype (hf_infer serves fp32 unless told; SGLang's own default is the
        model's torch_dtype, and it casts what it is sent): a learner in another one is cast on
        the way, never refused by an engine's dtype check. None: send as the learner holds."""
        served = self.infer.model_args.dtype or (
            "fp32" if self.infer.strategy_args.strategy_name == "hf_infer" else None
        )
        return torch_dtype(served) if served else None

    def sync(self, source: WeightSource, eval_engine: bool = True) -> dict[str, float]:
        """Broadcast `source`'s weights into every engine at its version (`lora_sync: native`:
        load its adapter by name, `weights/lora_native.py`); timing metrics. `eval_engine`
        False: not into a dedicated evaluation engine (it keeps the version it evaluates)."""
        return self.start_sync(source, False, eval_engine=eval_engine).result(self.ws.timeout_s * 4)

    def start_sync(
        self,
        source: WeightSource,
        copy: bool = True,
        then: Callable[[], None] | None = None,
        eval_engine: bool = True,
    ) -> concurrent.futures.Future:
        """`sync` on the control loop, returning at once: a future of its metrics. `copy`: of
        the weights as they are now, taken here (the source may train on meanwhile); `then`:
        called on the control loop once every engine holds them, before the future resolves."""
        version, groups = source.version, self._groups(eval_engine)
        device = source.sync_device  # read now: the learner's, never a thread's current one
        if copy:  # the copies are taken on this (the caller's) thread: select it there first
            select_device(device)
        if self.native is not None:
            tensors = _copied(source.adapter_for_sync(), copy)
            clients = [c for _, group in groups for c in group]
            job = self.native.sync(clients, tensors, version, self.pause_mode)
        else:
            copied = _copied(self._tensors(source), True) if copy else None
            job = self._broadcasts([s for s, _ in groups], source, copied, version, device)
        clients = [c for _, group in groups for c in group]
        synced = self._synced(job, version, then, clients)
        return asyncio.run_coroutine_threadsafe(synced, self.runner.loop)

    async def _broadcasts(
        self,
        senders: list[WeightSender],
        source: WeightSource,
        copied: list | None,
        version: int,
        device: Any,
    ) -> SyncStats:
        """Each weight group's sync in turn, of `copied` or else of `source`'s tensors afresh
        for each (the learner's weights_for_sync may gather or merge them one at a time);
        their stats summed. `version` and `device` were read when the sync started (the
        learner trains on). Runs on the control loop, which selects `device` before the
        learner's export starts on it (an export may allocate as soon as it is called)."""
        done = []
        for sender in senders:
            select_device(device)
            tensors = self._tensors(source) if copied is None else copied
            done.append(await sender.sync(
                tensors, version, bucket_bytes=int(self.ws.bucket_size_mb * 1024**2),
                load_format=self._load_format(), pause_mode=self.pause_mode,
                dtype=self._served_dtype(), device=device,
            ))  # fmt: skip
        seconds, nbytes = sum(d.seconds for d in done), sum(d.bytes for d in done)
        return SyncStats(version, seconds, nbytes, nbytes / max(seconds, 1e-9) / 1e9,
                         sum(d.buckets for d in done), sum(d.tensors for d in done))  # fmt: skip

    async def _synced(
        self, job: Any, version: int, then: Callable[[], None] | None, clients: list[EngineClient]
    ) -> dict:
        stats = await job
        self.counters["syncs"] += 1
        self.synced_version = version
        self.last_sync = {
            "sync/seconds": stats.seconds,
            "sync/gb_per_s": stats.gb_per_s,
            "sync/buckets": float(stats.buckets),
            "sync/bytes": float(stats.bytes),
        }
        if then is not None:
            then()  # admission opens for the version before the tallies are asked for
        await self._engine_tallies(clients)
        return dict(self.last_sync)

    def _tensors(self, source: WeightSource) -> Iterable[tuple[str, Any]]:
        """What a sync sends: a LoRA learner's adapter alone where `weight_sync.lora_sync`
        says so (auto: on hf_infer, the engine that loads adapters), else full weights (with
        LoRA, merged: `weights_for_sync`)."""
        mode = self.ws.lora_sync
        if mode == "auto":
            hf = self.infer.strategy_args.strategy_name == "hf_infer"
            mode = "adapter" if hf else "merge"
        adapter_for_sync = getattr(source, "adapter_for_sync", None)
        adapter = adapter_for_sync() if mode == "adapter" and adapter_for_sync else None
        return adapter if adapter is not None else source.weights_for_sync()

    def _load_format(self) -> str | None:
        fmt = self.ws.load_format
        if fmt == "auto":  # see WeightSyncConfig.load_format
            return "auto" if self.backend == "gloo" else "flattened_bucket"
        return "flattened_bucket" if fmt == "flattened_bucket" else None

    async def _engine_tallies(self, clients: list[EngineClient]) -> None:
        """What the synced engines report having done (`tallies.read_tallies`: pauses by mode,
        weight buckets by load_format, parameter tensors by dtype; hf engines only). An engine
        that does not answer leaves the last tallies in place: a metric never fails a sync
        that landed."""
        tallies = await read_tallies(clients)
        if tallies is not None:
            self.engine_tallies = tallies

    def metrics(self) -> dict[str, float]:
        return {f"engines/{k}": float(v) for k, v in self.counters.items()} | self.engine_tallies


def _copied(tensors: Any, copy: bool) -> Any:
    """`tensors` ((name, tensor) pairs), or a list of copies of them taken now."""
    if not copy or tensors is None:
        return tensors
    return [(name, t.detach().clone()) for name, t in tensors]


def _eval_index(num_engines: int, dedicated_eval: bool) -> int | None:
    """The dedicated evaluation engine's index (the last engine), or None."""
    if dedicated_eval and num_engines < 2:  # `config validate` refuses it first
        raise ValueError(
            f"logging.eval_engine: dedicated needs at least 2 engines, actor_infer has "
            f"{num_engines}"
        )
    return num_engines - 1 if dedicated_eval else None


def _senders(
    infer: WorkerConfig, weight_sync: WeightSyncConfig, dedicated_eval: bool
) -> tuple[WeightSender, WeightSender | None]:
    """The rollout engines' weight sender and, with a dedicated evaluation engine, its own: it
    meets the learner in a weight group of its own and is synced only at evaluation steps
    (`sync(eval_engine=True)`), so the rollout engines' syncs between them never wait for the
    evaluation in flight on it. hf engines join the update group through asyncrl's own code,
    which checks sealed (HMAC'd) rendezvous values; SGLang builds its own plain store."""
    seal = infer.strategy_args.strategy_name == "hf_infer"
    sender = WeightSender(timeout_s=weight_sync.timeout_s, seal=seal)
    if not dedicated_eval:
        return sender, None
    return sender, WeightSender(group_name=EVAL_GROUP, timeout_s=weight_sync.timeout_s, seal=seal)

"""The engine fleet's weight groups and weight sync (`FleetWeights`, which `EngineFleet`
extends): every group formed with rank 0 on the learner's sync device, and each sync --
broadcast buckets (or, with `lora_sync: native`, adapters loaded by name) -- run on the control
loop, with its metrics and what the engines then report having done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from asyncrl.config.schema import WeightSyncConfig, WorkerConfig
from asyncrl.device import resolve_backend, select_device, torch_dtype
from asyncrl.engine.client import EngineClient
from asyncrl.engine.tallies import read_tallies
from asyncrl.net import AsyncRunner, is_loopback, node_ip
from asyncrl.weights.lora_native import NativeLoraSync
from asyncrl.weights.sync import SyncStats, WeightSender, WeightSource

#: The weight group of a dedicated evaluation engine (`logging.eval_engine: dedicated`).
EVAL_GROUP = "asyncrl_weights_eval"


class FleetWeights:
    """`EngineFleet`'s weight-group and weight-sync methods, over the attributes its
    constructor sets."""

    infer: WorkerConfig
    ws: WeightSyncConfig
    pause_mode: str | None
    runner: AsyncRunner
    launcher: Any
    clients: list[EngineClient]
    num_engines: int
    eval_index: int | None
    multinode: bool
    backend: str
    sender: WeightSender
    eval_sender: WeightSender | None
    native: NativeLoraSync | None
    counters: Counter[str]
    last_sync: dict[str, float]
    engine_tallies: dict[str, float]
    synced_version: int | None

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

    def _rollout_engines(self) -> list[int]:
        """The engines rollout generates on: all of them, or all but the evaluation engine."""
        return [i for i in range(self.num_engines) if i != self.eval_index]

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


def _copied(tensors: Any, copy: bool) -> Any:
    """`tensors` ((name, tensor) pairs), or a list of copies of them taken now."""
    if not copy or tensors is None:
        return tensors
    return [(name, t.detach().clone()) for name, t in tensors]


def weight_senders(
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

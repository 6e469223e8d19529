"""The engine fleet: launch, weight-update group, weight sync, self-healing.

`hf_infer` engines are asyncrl's own server processes (one per engine, loopback); `sglang`
engines are SGLang servers (a router in front of several). Either way the fleet is driven
through the same SGLang-protocol client. An engine whose process dies is relaunched, the update
group is formed again with every engine, and the current weights are pushed before it serves
again.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Protocol

from asyncrl.config.schema import WeightSyncConfig, WorkerConfig
from asyncrl.device import DeviceSpec, resolve_backend
from asyncrl.engine.client import EngineClient
from asyncrl.engine.process import ServerHandle
from asyncrl.net import AsyncRunner
from asyncrl.weights.sync import WeightSender, WeightSource


class EngineLauncher(Protocol):
    """Starts the engines of one backend family (`actor_infer.strategy_args.strategy_name`)."""

    num_engines: int
    tp_size: int
    device: DeviceSpec
    """Where the engines receive weights (decides the update group's backend)."""

    def launch(self, index: int, port: int | None = None) -> ServerHandle:
        """Start (or attach to) engine `index`; a handle with `.url`, `.proc` and `.stop()`."""

    def actor_urls(self, worker_urls: list[str]) -> list[str]:
        """The URLs rollout workers generate through (a router, or the engines)."""

    def close(self) -> None:
        """Stop what the launcher started besides the engines (the router)."""


def make_launcher(infer: WorkerConfig, model_dir: Path, log_dir: Path, seed: int) -> EngineLauncher:
    """The launcher for `infer.strategy_args.strategy_name` (hf_infer | sglang)."""
    name = infer.strategy_args.strategy_name
    if name == "hf_infer":
        from asyncrl.engine.hf.launch import HFLauncher

        return HFLauncher(infer, model_dir, log_dir, seed)
    if name == "sglang":
        from asyncrl.device import detect_device
        from asyncrl.engine.sglang import SGLangLauncher

        return SGLangLauncher(infer, model_dir, log_dir, seed, detect_device())
    raise ValueError(f"actor_infer.strategy_args.strategy_name {name!r}: expected hf_infer|sglang")


class EngineFleet:
    """The engines of `actor_infer`, their clients, and the weight sender that feeds them."""

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
    ) -> None:
        self.infer, self.ws, self.pause_mode = infer, weight_sync, pause_mode
        self.request_timeout_s, self.runner = request_timeout_s, runner
        self.handles: list[ServerHandle] = []
        self.clients: list[EngineClient] = []
        self.counters: Counter[str] = Counter()
        self.last_sync: dict[str, float] = {}
        self.backend = "gloo"  # of the weight-update group; resolved by `_init_group`
        self.launcher = make_launcher(infer, model_dir, output_dir / "engine_logs", seed)
        self.num_engines = self.launcher.num_engines
        self.sender = WeightSender(timeout_s=weight_sync.timeout_s)

    # -- processes ---------------------------------------------------------------------------
    def start(self, source: WeightSource) -> None:
        """Launch every engine, form the update group and push `source`'s weights."""
        self.handles = [self.launcher.launch(i) for i in range(self.num_engines)]
        self.clients = [self._client(h.url) for h in self.handles]
        self._init_group()
        self.sync(source)

    def _client(self, url: str) -> EngineClient:
        async def make() -> EngineClient:  # aiohttp sessions belong to the control loop
            return EngineClient(url, timeout=self.request_timeout_s)

        return self.runner.run(make())

    def _init_group(self) -> None:
        ws = self.ws
        self.backend = resolve_backend(ws.backend, self.launcher.device)  # auto: nccl|hccl|gloo
        tp_sizes = [self.launcher.tp_size] * len(self.clients)  # engine i joins at 1 + i*tp
        args = (self.clients, ws.master_address, ws.master_port or None, self.backend)
        self.runner.run(
            self.sender.init_group(*args, ws.timeout_s, tp_sizes=tp_sizes),
            timeout=ws.timeout_s + 30,
        )

    def urls_for_worker(self, index: int) -> list[str]:
        """Every rollout worker may use every engine; workers start on different ones. With a
        router (sglang, several engines) every worker generates through the router."""
        urls = self.launcher.actor_urls([h.url for h in self.handles])
        shift = index % len(urls)
        return urls[shift:] + urls[:shift]

    def heal(self, source: WeightSource) -> bool:
        """Relaunch dead engine processes and bring them to `source`'s weights; True if any
        engine was relaunched."""
        dead = [i for i, h in enumerate(self.handles) if h.proc.poll() is not None]
        if not dead:
            return False
        for i in dead:
            # Same port, so workers keep their URLs; their failed prompts are re-issued.
            port = int(self.handles[i].url.rsplit(":", 1)[1])
            self.handles[i] = self.launcher.launch(i, port)
            self.counters["engine_restarts"] += 1
            print(f"asyncrl: engine {i} died; relaunched at {self.handles[i].url}")
        self._init_group()
        self.sync(source)
        return True

    def stop(self) -> None:
        try:
            self.runner.run(self.sender.close(), timeout=30)
        except Exception:  # noqa: BLE001 - engines may be gone already
            pass
        for client in self.clients:
            self.runner.run(client.close(), timeout=10)
        for handle in self.handles:
            handle.stop()
        self.launcher.close()

    # -- weights -----------------------------------------------------------------------------
    def sync(self, source: WeightSource) -> dict[str, float]:
        """Broadcast `source`'s weights into every engine at its version; timing metrics."""
        import torch

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.infer.model_args.dtype)
        stats = self.runner.run(
            self.sender.sync(
                source.weights_for_sync(),
                source.version,
                bucket_bytes=int(self.ws.bucket_size_mb * 1024**2),
                load_format=self._load_format(),
                pause_mode=self.pause_mode,
                dtype=dtype,
            ),
            timeout=self.ws.timeout_s * 4,
        )
        self.counters["syncs"] += 1
        self.last_sync = {
            "sync/seconds": stats.seconds,
            "sync/gb_per_s": stats.gb_per_s,
            "sync/buckets": float(stats.buckets),
        }
        return dict(self.last_sync)

    def _load_format(self) -> str | None:
        fmt = self.ws.load_format
        if fmt == "auto":  # see WeightSyncConfig.load_format
            return "auto" if self.backend == "gloo" else "flattened_bucket"
        return "flattened_bucket" if fmt == "flattened_bucket" else None

    def metrics(self) -> dict[str, float]:
        return {f"engines/{k}": float(v) for k, v in self.counters.items()}

"""Engine launchers, one per `actor_infer.strategy_args.strategy_name`, behind one factory.

A launcher starts engine `index` (again at a given port, when healing), says where rollout
actors should send generation, how many engines there are and their tensor-parallel size, and
which device their weight-update group runs on. `EngineSet` drives either kind identically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from asyncrl.device import SPECS, DeviceSpec, detect_device


class EngineLauncher(Protocol):
    num_engines: int
    tp_size: int
    device: DeviceSpec
    """Where the engines receive weights (decides the update group's backend)."""

    def launch(self, index: int, port: int | None = None) -> Any:
        """Start (or attach to) engine `index`; a handle with `.url`, `.proc` and `.stop()`."""

    def actor_urls(self, worker_urls: list[str]) -> list[str]:
        """The URLs rollout actors generate through (a router, or the workers)."""

    def close(self) -> None:
        """Stop what the launcher started besides the engines (the router)."""


class HFLauncher:
    """asyncrl's own transformers server (`hf_infer`): one CPU process per engine, loopback."""

    def __init__(self, infer: Any, model_dir: Path, log_dir: Path, seed: int) -> None:
        self.infer, self.model_dir, self.log_dir, self.seed = infer, model_dir, log_dir, seed
        self.num_engines = max(1, len(infer.device_mapping) // infer.num_gpus_per_worker)
        self.tp_size = 1
        self.device = SPECS["cpu"]

    def launch(self, index: int, port: int | None = None) -> Any:
        from asyncrl.rollout.hf_launch import launch_hf_server

        self.log_dir.mkdir(parents=True, exist_ok=True)
        return launch_hf_server(
            self.model_dir,
            port=port,
            dtype=self.infer.model_args.dtype or "fp32",
            max_batch_size=int(self.infer.strategy_args.strategy_config.get("max_batch_size", 64)),
            seed=self.seed + index,
            log_dir=self.log_dir,
            timeout_s=180.0,
        )

    def actor_urls(self, worker_urls: list[str]) -> list[str]:
        return list(worker_urls)

    def close(self) -> None:
        pass


def make_launcher(infer: Any, model_dir: Path, log_dir: Path, seed: int) -> EngineLauncher:
    """The launcher for `infer.strategy_args.strategy_name` (hf_infer | sglang)."""
    name = infer.strategy_args.strategy_name
    if name == "hf_infer":
        return HFLauncher(infer, model_dir, log_dir, seed)
    if name == "sglang":
        from asyncrl.rollout.sglang_launch import SGLangLauncher

        return SGLangLauncher(infer, model_dir, log_dir, seed, detect_device())
    raise ValueError(f"actor_infer.strategy_args.strategy_name {name!r}: expected hf_infer|sglang")

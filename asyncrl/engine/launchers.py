"""Engine launchers: one per backend family (`actor_infer.strategy_args.strategy_name`), chosen by
`make_launcher`; multi-node, the backend's own launcher runs on each node under a
`PlacedLauncher` (`engine/placement.py`). The fleet (`engine/fleet.py`) drives whichever it gets."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Protocol

from asyncrl.config.schema import ClusterConfig, WorkerConfig
from asyncrl.device import DeviceSpec
from asyncrl.engine.process import ServerHandle
from asyncrl.weights.lora_native import NativeLora


class EngineLauncher(Protocol):
    """Starts the engines of one backend family (`actor_infer.strategy_args.strategy_name`)."""

    num_engines: int
    tp_size: int
    device: DeviceSpec
    """Where the engines receive weights (decides the update group's backend)."""
    api_key: str | None
    """The key every engine requires (None: no authentication)."""

    def launch(self, index: int, port: int | None = None) -> ServerHandle:
        """Start (or attach to) engine `index`; a handle with `.url`, `.proc` and `.stop()`."""

    def actor_urls(self, worker_urls: list[str]) -> list[str]:
        """The URLs rollout workers generate through (a router, or the engines)."""

    def routes(self, engines: int) -> bool:
        """Whether `actor_urls` of `engines` engines is a router (whose /generate takes no
        batch: `EngineClient(router=True)`)."""

    def close(self) -> None:
        """Stop what the launcher started besides the engines (the router)."""


def make_launcher(
    infer: WorkerConfig,
    model_dir: Path,
    log_dir: Path,
    seed: int,
    api_key: str | None = None,
    eval_priority: int | None = None,
    cluster: ClusterConfig | None = None,
    lora: NativeLora | None = None,
) -> EngineLauncher:
    """The launcher for `infer.strategy_args.strategy_name` (hf_infer | sglang).
    `lora`: `weight_sync.lora_sync: native` (SGLang engines launched with LoRA enabled).
    `eval_priority`: the evaluation requests' priority (None: no evaluation); SGLang needs its
    priority scheduler switched on at launch when it differs from rollout's 0, ours does not.
    With `cluster.address` (multi-node) the engines are Ray actors placed on the cluster's
    nodes, each running this same launcher on its node (`engine/placement.py`)."""
    cluster = cluster or ClusterConfig()
    args = (infer, model_dir, log_dir, seed, api_key, eval_priority, cluster.bind_host, lora)
    local = local_launcher(*args)
    if not cluster.address.strip():
        return local
    from asyncrl.engine.placement import PlacedLauncher

    return PlacedLauncher(local, functools.partial(local_launcher, *args), cluster)


def local_launcher(
    infer: WorkerConfig,
    model_dir: Path,
    log_dir: Path,
    seed: int,
    api_key: str | None,
    eval_priority: int | None,
    host: str,
    lora: NativeLora | None = None,
) -> EngineLauncher:
    """The backend's own launcher: servers on this node, bound to `host`."""
    name = infer.strategy_args.strategy_name
    if name == "hf_infer":
        from asyncrl.engine.hf.launch import HFLauncher

        return HFLauncher(infer, model_dir, log_dir, seed, api_key, host=host)
    if name == "sglang":
        from asyncrl.device import detect_device
        from asyncrl.engine.sglang import LoraServing, SGLangLauncher

        serving = LoraServing(lora.rank, lora.target_modules) if lora else None
        return SGLangLauncher(
            infer, model_dir, log_dir, seed, detect_device(), api_key,
            eval_priority=eval_priority, host=host, lora=serving,
        )  # fmt: skip
    raise ValueError(f"actor_infer.strategy_args.strategy_name {name!r}: expected hf_infer|sglang")

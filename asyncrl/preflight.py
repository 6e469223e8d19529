"""What this machine must have for the configured backends, checked before anything starts.

`config validate` checks a config on its own (it is often checked on another machine); this
checks it against the machine that is about to run it: the packages each backend imports and
the accelerator it drives. A piece that is missing is one line naming it (`MissingPieceError`,
exit status 2 from the CLI), before a model is built, Ray starts or an engine is launched —
never an ImportError deep in a worker or an engine's log tail.
"""

from __future__ import annotations

import importlib.util
from typing import Any


class MissingPieceError(RuntimeError):
    """A configured backend needs a package or a device this machine does not have."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is absent or broken
        return False


def _server_urls(worker: Any) -> list[str]:
    return list(worker.strategy_args.strategy_config.get("server_urls") or [])


def missing_pieces(cfg: Any, device_kind: str) -> list[str]:
    """One line per backend of `cfg` that cannot run here (empty: all can). `device_kind` is
    this machine's accelerator (cuda | npu | cpu, from `asyncrl.device.detect_device`)."""
    missing = []
    infer = cfg.actor_infer.strategy_args.strategy_name
    # Engines asyncrl launches itself run here; servers the config names (server_urls) run
    # wherever they run, and only their HTTP API is needed.
    if infer == "sglang" and not _server_urls(cfg.actor_infer):
        if not _installed("sglang"):
            missing.append(
                "actor_infer.strategy_args.strategy_name: sglang needs the sglang package "
                "(pip install 'asyncrl[sglang]'), or hf_infer on this machine"
            )
        elif device_kind == "cpu":
            missing.append(
                "actor_infer.strategy_args.strategy_name: sglang needs a GPU or NPU, and this "
                "machine has none (use hf_infer)"
            )
    for role in ("actor_train", "critic"):
        worker = getattr(cfg, role, None)
        if worker is None or worker.strategy_args.strategy_name != "megatron_train":
            continue
        need = ["megatron.core"] + (["torch_npu", "mindspeed"] if device_kind == "npu" else [])
        absent = [m for m in need if not _installed(m)]
        if device_kind == "cpu":  # its DDP and optimizers call CUDA/NPU APIs
            missing.append(
                f"{role}.strategy_args.strategy_name: megatron_train needs a GPU or NPU, and "
                "this machine has none (megatron-core trains on CUDA/NPU only; use fsdp2_train)"
            )
        elif absent:
            missing.append(
                f"{role}.strategy_args.strategy_name: megatron_train needs "
                f"{', '.join(absent)} (pip install 'asyncrl[megatron]'"
                f"{'; on Ascend also asyncrl[npu]' if device_kind == 'npu' else ''})"
            )
    return missing + _fsdp2_pieces(cfg, device_kind)


def _fsdp2_pieces(cfg: Any, device_kind: str) -> list[str]:
    """What an fsdp2_train learner over several ranks cannot do on this machine: CPU offload
    where the ranks compute on the CPU (everything is in host memory already). Accelerator
    ranks across nodes are placed by `asyncrl/learner/placement.py`."""
    train, missing = cfg.actor_train, []
    if train.strategy_args.strategy_name != "fsdp2_train" or len(train.device_mapping) < 2:
        return missing
    sc = train.strategy_args.strategy_config
    if device_kind == "cpu" and (sc.get("offload_params") or sc.get("offload_optimizer")):
        missing.append(
            "actor_train.strategy_args.strategy_config.offload_params: this machine has no "
            "accelerator; the learner computes on the CPU, where parameters and optimizer "
            "state are in host memory already (nothing to offload): remove it"
        )
    return missing


def check_machine(cfg: Any) -> None:
    """Raise `MissingPieceError` (one line per missing piece), `RewardError` (the reward's
    package is missing) or `DeviceError` (the configured device or weight-sync backend is
    absent) if `cfg` cannot run on this machine."""
    from asyncrl.device import detect_device, resolve_backend
    from asyncrl.rewards import get_reward_fn

    get_reward_fn(cfg.rollout.reward_fn)  # RewardError: its package is missing (math-verify)
    device = detect_device()  # DeviceError when ASYNCRL_DEVICE names an absent device
    missing = missing_pieces(cfg, device.kind)
    if missing:
        raise MissingPieceError("; ".join(missing))
    resolve_backend(cfg.weight_sync.backend, device)  # DeviceError: nccl/hccl on the wrong device

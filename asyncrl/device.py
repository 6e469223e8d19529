"""Which accelerator this process drives, and everything that follows from it.

    cuda -> backend nccl, visibility CUDA_VISIBLE_DEVICES,      Ray resource GPU
    npu  -> backend hccl, visibility ASCEND_RT_VISIBLE_DEVICES, Ray resource NPU (torch_npu)
    cpu  -> backend gloo, no visibility variable,               no Ray accelerator resource

Detection order: `ASYNCRL_DEVICE` (cuda | npu | cpu) if set, then CUDA, then Ascend (only when
`torch_npu` imports), then the CPU. On Ascend, `torch_npu` must be imported before any NPU call,
and MindSpeed's `mindspeed.megatron_adaptor` before anything from Megatron (it patches
Megatron's `torch.cuda.*` calls onto the NPU): `prepare_megatron_imports` does both, in order.
Nothing here imports torch at module load, so the config CLI stays fast.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("cuda", "npu", "cpu")

# Ray sets a worker's visibility variable from its own resources unless told not to; ranks that
# asyncrl pins to a device_mapping entry set it themselves.
NOSET = {
    "cuda": "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    "npu": "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES",
}
ENV_OVERRIDE = "ASYNCRL_DEVICE"


class DeviceError(RuntimeError):
    """The requested device is absent, or its software stack is missing or mis-ordered."""


@dataclass(frozen=True)
class DeviceSpec:
    kind: str
    """cuda | npu | cpu."""
    backend: str
    """torch.distributed backend for collectives on this device: nccl | hccl | gloo."""
    visibility_env: str | None
    """Environment variable that restricts a process to some devices (None on the CPU)."""
    ray_resource: str | None
    """Ray resource name of one device (None on the CPU)."""

    def visibility(self, devices: Sequence[int]) -> dict[str, str]:
        """The environment that makes exactly `devices` visible (empty on the CPU)."""
        if self.visibility_env is None:
            return {}
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in devices):
            raise DeviceError(f"device ids must be non-negative ints, got {list(devices)}")
        return {self.visibility_env: ",".join(str(d) for d in devices)}

    def ray_options(self, count: int) -> dict[str, Any]:
        """Ray actor options that reserve `count` devices of this kind."""
        if self.kind == "cuda":
            return {"num_gpus": count}
        if self.kind == "npu":
            return {"resources": {"NPU": count}}
        return {}

    def torch_device(self, index: int = 0) -> Any:
        import torch

        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.kind, index)

    def pinned_env(self, device_id: int) -> dict[str, str]:
        """The environment of a Ray actor that must see exactly device `device_id`: the
        visibility variable, and Ray told not to override it (empty on the CPU)."""
        noset = NOSET.get(self.kind)
        return {} if noset is None else {noset: "1", **self.visibility([device_id])}

    def group_backend(self) -> str:
        """A training group's backend: gloo on the CPU; on an accelerator, its collective
        library for device tensors with gloo beside it for CPU ones (counts, object gathers)."""
        return "gloo" if self.kind == "cpu" else f"cpu:gloo,{self.kind}:{self.backend}"


def select_device(device: Any, kind: str = "cuda") -> None:
    """Make `device` ("cuda:1", a torch.device, or an index of `kind`) the calling thread's
    current accelerator (each thread has its own; a new one starts on device 0): NCCL/HCCL, a
    DeviceMesh and allocations that name no device use the current one. No-op on the CPU."""
    import torch

    dev = torch.device(kind, device) if isinstance(device, int) else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif dev.type == "npu":
        torch.npu.set_device(dev)  # type: ignore[attr-defined]


SPECS = {
    "cuda": DeviceSpec("cuda", "nccl", "CUDA_VISIBLE_DEVICES", "GPU"),
    "npu": DeviceSpec("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", "NPU"),
    "cpu": DeviceSpec("cpu", "gloo", None, None),
}


def device_spec(kind: str) -> DeviceSpec:
    try:
        return SPECS[kind]
    except KeyError:
        raise DeviceError(f"unknown device {kind!r}; expected one of {', '.join(KINDS)}") from None


def _npu_available() -> bool:
    try:
        import torch
        import torch_npu  # noqa: F401  registers torch.npu
    except ImportError:
        return False
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def detect_device(prefer: str | None = None) -> DeviceSpec:
    """The device of this process: `prefer`, else `$ASYNCRL_DEVICE`, else the first present.

    A preferred accelerator that is not present is an error, never a silent CPU fallback.
    """
    wanted = prefer or os.environ.get(ENV_OVERRIDE) or None
    if wanted is not None:
        spec = device_spec(wanted)
        present = {"cuda": _cuda_available, "npu": _npu_available}.get(spec.kind)
        if present is not None and not present():
            hint = " (is torch_npu installed?)" if spec.kind == "npu" else ""
            raise DeviceError(f"device {spec.kind} requested but none is available{hint}")
        return spec
    if _cuda_available():
        return SPECS["cuda"]
    if _npu_available():
        return SPECS["npu"]
    return SPECS["cpu"]


def resolve_backend(configured: str, device: DeviceSpec) -> str:
    """`weight_sync.backend`: `auto` follows the device; an explicit backend must fit it."""
    if configured == "auto":
        return device.backend
    if configured not in ("gloo", "nccl", "hccl"):
        raise DeviceError(f"unknown weight-sync backend {configured!r}")
    if configured != "gloo" and configured != device.backend:
        raise DeviceError(
            f"weight-sync backend {configured} does not run on the {device.kind} device "
            f"(use {' or '.join(sorted({device.backend, 'gloo'}))})"
        )
    return configured


def prepare_megatron_imports(device: DeviceSpec) -> None:
    """Import what must precede Megatron on this device; call before importing `megatron`.

    On Ascend this imports `torch_npu` and then `mindspeed.megatron_adaptor`. MindSpeed patches
    Megatron at import time, so Megatron imported earlier would run unpatched CUDA calls: that
    is refused with an error rather than left to fail deep inside a kernel.
    """
    if device.kind != "npu":
        return
    if "mindspeed.megatron_adaptor" in sys.modules:
        return
    early = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
    if early:
        raise DeviceError(
            f"{early[0]} was imported before mindspeed.megatron_adaptor; on Ascend the adaptor "
            "must be imported first (call prepare_megatron_imports before any Megatron import)"
        )
    for module, package in (
        ("torch_npu", "torch-npu"),
        ("mindspeed.megatron_adaptor", "mindspeed"),
    ):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise DeviceError(
                f"the Ascend Megatron path needs {module} (package {package}): {e}"
            ) from None


def worker_device(mapping: list[int], kind: str) -> str:
    """The torch device of a one-process worker: `<kind>:<first id>` on an accelerator when the
    worker names devices (`device_mapping`), else the CPU."""
    return f"{kind}:{mapping[0]}" if mapping and kind != "cpu" else "cpu"


def torch_dtype(name: str) -> Any:
    """The torch dtype of a config's `model_args.dtype` name (fp32 | bf16 | fp16)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]

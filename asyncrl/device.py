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

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator, Sequence
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


def select_device(device: str | int, kind: str = "cuda") -> None:
    """Make `device` ("cuda:1", or an index of `kind`) this process's current accelerator:
    NCCL/HCCL and a DeviceMesh start on the current device. No-op on the CPU."""
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


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's CPU threads set to `threads` (0: unchanged) inside the block, restored after."""
    import torch

    saved = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


# -- CPU thread budget -------------------------------------------------------------------------
# torch gives every process as many intra-op threads as the machine has cores. A run on a small
# CPU box has at least two such processes (the learner and an engine server), so each would run
# its matrix products on every core while the other does too: both slow down. The budget splits
# the usable cores between the CPU-bound processes of the run (learner ranks, local engine
# servers) and, where they fit, pins each to its own cores. Rollout workers and Ray's own
# processes are I/O-bound and are neither budgeted nor pinned.


class ThreadBudgetError(ValueError):
    """A `threads` setting that cannot be honoured on this machine."""


@dataclass(frozen=True)
class ThreadShare:
    """What one process gets: `threads` torch intra-op threads (0: torch's default, not
    budgeted) and the `cpus` it is pinned to (empty: not pinned)."""

    threads: int = 0
    cpus: tuple[int, ...] = ()

    def args(self) -> list[str]:
        """The hf engine server's command-line arguments for this share."""
        out = ["--num-threads", str(self.threads)] if self.threads > 0 else []
        return out + (["--cpus", ",".join(map(str, self.cpus))] if self.cpus else [])


@dataclass(frozen=True)
class ThreadBudget:
    """One share per learner rank (rank 0 is the driver) and one per local engine server."""

    learner: tuple[ThreadShare, ...]
    engines: tuple[ThreadShare, ...]
    cores: int
    note: str = ""
    """Why some processes are not pinned (empty when every budgeted one is)."""

    def describe(self) -> str:
        """One line for the run's log."""

        def part(name: str, shares: tuple[ThreadShare, ...]) -> str:
            if not shares:
                return f"{name}: none local"
            counts = sorted({s.threads for s in shares if s.threads}, reverse=True)
            what = "/".join(map(str, counts)) + " thread(s)" if counts else "torch default"
            if counts and not all(s.threads for s in shares):
                what += " (the rest: torch default)"
            pins = "; ".join(",".join(map(str, x.cpus)) for x in shares if x.cpus)
            return f"{len(shares)} {name} x {what}" + (f" on cpus [{pins}]" if pins else "")

        text = f"{part('learner', self.learner)}, {part('engine', self.engines)} on {self.cores}"
        return (
            text
            + " usable cores; rollout workers unbudgeted"
            + (f" ({self.note})" if self.note else "")
        )


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity mask: a container's or taskset's cpu
    set, not the machine's count)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: every core
        return list(range(os.cpu_count() or 1))


def _explicit(name: str, value: int | str, cores: int) -> int | None:
    """An explicit thread count (checked), or None for auto."""
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ThreadBudgetError(f"threads.{name} must be auto or an integer >= 1, got {value!r}")
    if value > cores:
        raise ThreadBudgetError(
            f"threads.{name} {value} exceeds the {cores} usable cores of this machine"
        )
    return value


def _auto_counts(cores: int, ranks: int, engines: int, fixed: dict[str, int | None]) -> list[int]:
    """Threads per process (ranks first, then engines): explicit roles keep their counts, the
    auto ones share what is left evenly, at least 1 each. Leftover cores go to the learner
    ranks when every rank can have one (the learner's step is the loop's critical path, and
    FSDP ranks wait for the slowest), else one each to engines; any still left stay free."""
    roles = ["learner"] * ranks + ["engine"] * engines
    counts = [fixed[r] or 0 for r in roles]
    auto = [i for i, r in enumerate(roles) if fixed[r] is None]
    if not auto:
        return counts
    base, extra = divmod(max(0, cores - sum(counts)), len(auto))
    auto_ranks = [i for i in auto if roles[i] == "learner"]
    bonus = auto_ranks if auto_ranks and extra >= len(auto_ranks) else []
    bonus += [i for i in auto if roles[i] == "engine"][: extra - len(bonus)]
    for i in auto:
        counts[i] = max(1, base + (i in bonus))
    return counts


def plan_threads(
    cores: Sequence[int],
    ranks: int,
    engines: int,
    learner: int | str = "auto",
    engine: int | str = "auto",
    pin: bool = True,
    learner_on_cpu: bool = True,
) -> ThreadBudget:
    """The run's thread budget on `cores` (the usable core ids) for `ranks` learner processes
    and `engines` local CPU engine servers. `auto` splits the cores between the CPU-bound
    processes; an integer is that many threads per process of the role. A learner on an
    accelerator is not budgeted under auto (its CPU threads feed the device, and taking them
    would starve it). `pin`: each budgeted process on cores of its own, when they all fit;
    otherwise none is pinned and `note` says why. Raises ThreadBudgetError for a count below 1
    or above the cores."""
    n = len(cores)
    fixed = {"learner": _explicit("learner", learner, n), "engine": _explicit("engine", engine, n)}
    cpu_ranks = ranks if learner_on_cpu or fixed["learner"] is not None else 0
    counts = _auto_counts(n, cpu_ranks, engines, fixed)
    note = ""
    if not pin:
        note = "pinning off"
    elif not hasattr(os, "sched_setaffinity"):
        note = "this OS cannot pin threads"
    elif sum(counts) > n:
        note = f"{sum(counts)} threads on {n} cores: oversubscribed, not pinned"
    placed: list[tuple[int, ...]] = []
    start = 0
    for c in counts:
        placed.append(tuple(cores[start : start + c]) if pin and not note else ())
        start += c
    shares = [ThreadShare(c, cpus) for c, cpus in zip(counts, placed)]
    if not learner_on_cpu and fixed["learner"] is not None:  # set, never pinned off the CPU
        shares[:cpu_ranks] = [ThreadShare(c) for c in counts[:cpu_ranks]]
    learners = tuple(shares[:cpu_ranks]) or tuple(ThreadShare() for _ in range(ranks))
    return ThreadBudget(learners, tuple(shares[cpu_ranks:]), n, note)


def apply_thread_share(share: ThreadShare, whole_process: bool = False) -> None:
    """Give this process its share for good (a process started for it: an engine server, a
    learner rank): torch's intra-op threads, inter-op to 1 (where torch still allows it: it
    refuses once inter-op work ran), and its cpus (`pin_threads`)."""
    import torch

    if share.threads > 0:
        torch.set_num_threads(share.threads)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
    if share.cpus:
        pin_threads(share.cpus, whole_process)


def pin_threads(cpus: Sequence[int], whole_process: bool = False) -> None:
    """Pin to `cpus`: every thread this process has now when `whole_process`, else the calling
    thread (on Linux an affinity belongs to a thread; a new thread or child process inherits
    its creator's)."""
    tids = [0]
    if whole_process and os.path.isdir("/proc/self/task"):
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)


class DriverThreads:
    """The driver's share (it is learner rank 0): torch's threads from `__enter__`, every
    thread pinned from `pin()` -- called once the run's other processes are started, since a
    child inherits its creator's pinning (Ray's processes, the rollout workers: never pinned)
    -- and both restored at exit: the process may outlive the run (tests, a notebook), and a
    next run measures the usable cores afresh. Inter-op threads are left alone (torch allows
    setting them once per process)."""

    def __init__(self, share: ThreadShare) -> None:
        self.share = share
        self._saved: tuple[int, list[int]] | None = None
        self._pinned = False

    def __enter__(self) -> DriverThreads:
        import torch

        self._saved = (torch.get_num_threads(), usable_cores())
        if self.share.threads > 0:
            torch.set_num_threads(self.share.threads)
        return self

    def pin(self) -> None:
        if self.share.cpus and not self._pinned:
            pin_threads(self.share.cpus, whole_process=True)
            self._pinned = True

    def __exit__(self, *exc: object) -> None:
        import torch

        assert self._saved is not None, "DriverThreads used outside `with`"
        torch.set_num_threads(self._saved[0])
        if self._pinned:
            pin_threads(self._saved[1], whole_process=True)
            self._pinned = False

"""Learner side of the weight sync: one group, bucketed broadcasts, versions, timeouts.

Protocol (SGLang's, slime's order):
  init_group: learner = rank 0, engine i joins at rank_offset = 1 + sum(tp sizes before i),
      world_size = 1 + sum(tp sizes). The HTTP `/init_weights_update_group` calls and the
      learner's own join run concurrently (they rendezvous on the learner's TCPStore).
  sync: every engine `prepare_update(pause_mode)` (pause; flush once idle where the mode
      allows; begin the weight-update session where the engine's version requires one) -> per
      bucket: POST `/update_weights_from_distributed` to every engine concurrently, then
      broadcast the bucket (src=0), then wait for every reply -> every engine
      `finish_update(version)` (end the session, set the version where the bucket's is lost,
      continue). The version rides on the last bucket only, so an engine never reports the new
      version with half of the new weights; no bucket asks for a flush (`flush_cache=False`):
      a flush while paused requests hold KV kills SGLang <= 0.5.22 (`assert
      flush_cache_success`); the engine side decides when a flush can succeed.

Nothing here waits without a bound: HTTP waits share one per-bucket deadline and the group's
collectives carry the same timeout, so a stalled engine ends in `WeightSyncError` naming it.
After a failed sync the engines stay paused (their weights may be half updated) and the
group is marked broken; call `init_group` again (or discard the engines).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from asyncrl.device import select_device
from asyncrl.net import in_daemon_thread
from asyncrl.weights.buckets import (
    BucketLayoutError,
    StagingBuffer,
    bucket_format,
    bucketize,
    dtype_name,
    flat_layout,
    flatten_bucket,
    tensor_nbytes,
    with_last,
)
from asyncrl.weights.group import (
    broadcast,
    create_group,
    destroy_group,
    on_device,
    rendezvous_port,
    sealed_group_name,
    shown,
    staging_device,
)

__all__ = ["SyncStats", "WeightSender", "WeightSource", "WeightSyncError", "WeightTarget"]


class WeightTarget(Protocol):
    """An engine as the sender sees it (SGLang's weight-update endpoints). A failed call raises
    an exception; one with a `problem` attribute (the engine client's) is reported by it."""

    url: str

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float | None,
    ) -> object: ...

    async def update_weights(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: int | None,
        load_format: str | None,
        group_name: str,
        flush_cache: bool,
        timeout_s: float | None,
    ) -> object: ...

    async def prepare_update(self, pause_mode: str | None, timeout_s: float) -> None:
        """Pause (None: don't), flush when possible, open a session where required."""

    async def finish_update(self, version: int, pause_mode: str | None) -> None:
        """Close the session, make the engine report `version`, continue if paused."""

    async def destroy_weights_update_group(self, group_name: str) -> object: ...


class WeightSource(Protocol):
    """What is synced: a learner's version, its full tensors under Hugging Face names, and
    the device they are on (`sync_device`: where the sync stages them and rank 0 of the
    update group communicates from; the thread that drives `weights_for_sync` has it made
    current first, so what the export allocates without naming a device lands there too)."""

    @property
    def version(self) -> int: ...

    @property
    def sync_device(self) -> torch.device: ...

    def weights_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class WeightSyncError(RuntimeError):
    """A weight sync or group set-up failed or stalled; the message names the engine(s)."""


@dataclass(frozen=True)
class SyncStats:
    version: int
    seconds: float
    bytes: int
    gb_per_s: float
    buckets: int
    tensors: int


class WeightSender:
    """Rank 0 of the weight-update group. `seal`: all engines are hf servers; a gloo group then
    meets under a fresh `sealed_group_name()` (weights/group.py) each time.

    The learner's device (its `sync_device`) is handed to `init_group` and to every `sync`,
    never read from the state of the thread that happens to make the sender or run the sync:
    the buckets are staged there and rank 0 communicates from there, and every thread the
    sender allocates or communicates on (the control loop's, the collectives' daemon threads)
    selects it first."""

    def __init__(
        self, *, group_name: str = "asyncrl_weights", timeout_s: float = 120.0, seal: bool = False
    ) -> None:
        self.group_name, self._plain_name, self._seal = group_name, group_name, seal
        self.timeout_s = timeout_s
        self.engines: list[WeightTarget] = []
        self._group = None
        self._backend = "gloo"
        self._device = torch.device("cpu")
        self._broken: str | None = None
        self._offsets: dict[str, tuple[int, int]] = {}  # engine url -> its ranks [lo, hi)
        self._staging = StagingBuffer()  # flattened buckets are packed here, one at a time

    async def init_group(
        self,
        engines: Sequence[WeightTarget],
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str = "gloo",
        timeout_s: float | None = None,
        tp_sizes: Sequence[int] | None = None,
        device: torch.device | None = None,
    ) -> None:
        """Form the group: this process is rank 0, on `device` (the learner's `sync_device`;
        None: device 0 of the backend's kind, see `staging_device`). Raises WeightSyncError
        naming failures."""
        if self._group is not None:
            await self.close()
        timeout = timeout_s or self.timeout_s
        tp_sizes = list(tp_sizes or [1] * len(engines))
        if len(tp_sizes) != len(engines) or not engines or min(tp_sizes) < 1:
            raise WeightSyncError("need >= 1 engine and one tp size >= 1 per engine")
        port = master_port or rendezvous_port(master_address)  # free where the engines connect
        sealed = self._seal and backend == "gloo"  # SGLang's NCCL side cannot check sealed values
        self.group_name = sealed_group_name() if sealed else self._plain_name
        world = 1 + sum(tp_sizes)
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(engines))]
        self._offsets = {e.url: (o, o + n) for e, o, n in zip(engines, offsets, tp_sizes)}
        calls = {
            asyncio.create_task(
                e.init_weights_update_group(
                    master_address, port, off, world, self.group_name, backend, timeout + 10
                )
            ): e
            for e, off in zip(engines, offsets)
        }
        staging = staging_device(backend, device)
        mine = in_daemon_thread(
            on_device, staging, create_group,
            backend, master_address, port, 0, world, self.group_name, timeout,
        )  # fmt: skip
        try:
            what = f"init of group {shown(self.group_name)!r}"
            await self._wait_all(calls, mine, timeout + 15, what)
        except WeightSyncError:
            # An engine failed; our half of the group is useless whenever it completes.
            mine.add_done_callback(lambda f: f.exception() or destroy_group(f.result()))
            raise
        self._group, self.engines = mine.result(), list(engines)
        self._backend, self._device, self._broken = backend, staging, None

    @property
    def device(self) -> torch.device:
        """Where buckets are staged and rank 0 of the group communicates from (the CPU
        until a group is formed, and for gloo)."""
        return self._device

    async def sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        bucket_bytes: int = 512 * 1024**2,
        load_format: str | None = "flattened_bucket",
        pause_mode: str | None = "abort",
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> SyncStats:
        """Send full tensors under HF names (floating ones cast to `dtype` if given).

        `load_format`: "flattened_bucket", None (one broadcast per tensor) or "auto" (chosen
        per bucket by `buckets.bucket_format`). `device`: the learner's `sync_device` now; it must
        be the one the group was formed on (None: that one)."""
        if self._group is None:
            raise WeightSyncError("no weight update group: call init_group first")
        if self._broken:
            raise WeightSyncError(f"group broken by an earlier failure ({self._broken})")
        if load_format not in (None, "flattened_bucket", "auto"):
            raise WeightSyncError(f"unknown load_format {load_format!r}")
        self._check_device(device)
        # This (the control) thread pulls `named_tensors`: a learner's export allocates and
        # gathers as it yields, and `_prepare` copies onto the staging device.
        select_device(self._device)
        start, nbytes, nbuckets, ntensors = time.perf_counter(), 0, 0, 0
        what = f"pause({pause_mode})" if pause_mode else "begin update"
        await self._control(lambda e: e.prepare_update(pause_mode, self.timeout_s), what)
        converted = ((n, self._prepare(t, dtype)) for n, t in named_tensors)
        try:
            flat = load_format is not None  # one dtype per (possibly) flattened bucket
            for bucket, last in with_last(bucketize(converted, bucket_bytes, split_dtypes=flat)):
                fmt = bucket_format(bucket) if load_format == "auto" else load_format
                nbytes += await self._send_bucket(
                    bucket, version if last else None, fmt, False, nbuckets
                )
                nbuckets += 1
                ntensors += len(bucket)
        except BucketLayoutError as e:  # raised before that bucket was announced: group intact
            raise WeightSyncError(f"cannot send weights for version {version}: {e}") from None
        finally:
            self._staging.finish()
        if nbuckets == 0:
            raise WeightSyncError(f"no tensors to send for version {version}")
        what = "continue_generation" if pause_mode else "end update"
        await self._control(lambda e: e.finish_update(version, pause_mode), what)
        secs = time.perf_counter() - start
        return SyncStats(version, secs, nbytes, nbytes / max(secs, 1e-9) / 1e9, nbuckets, ntensors)

    async def close(self) -> None:
        """Tear the group down on the engines (best effort) and here."""
        group, self._group = self._group, None
        self._staging.release()
        if group is None:
            return
        calls = [e.destroy_weights_update_group(self.group_name) for e in self.engines]
        await asyncio.gather(*calls, return_exceptions=True)
        destroy_group(group)

    # ---- internals ---------------------------------------------------------------------------
    def _check_device(self, device: torch.device | None) -> None:
        """A learner now on another device than the group's rank 0: refused before any call
        (the group stays usable), since its communicator is bound to the device it formed on."""
        if device is None:
            return
        wanted = staging_device(self._backend, device)
        if wanted != self._device:
            raise WeightSyncError(
                f"the learner's weights are on {device} (staged on {wanted}) but the update "
                f"group was formed on {self._device}: form the group again (init_group)"
            )

    def _prepare(self, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return t.detach().to(device=self._device, dtype=target).contiguous()

    async def _send_bucket(self, bucket, version, load_format, flush, index: int) -> int:
        names = [n for n, _ in bucket]
        tensors = [t for _, t in bucket]
        dtypes = [dtype_name(t.dtype) for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        calls = {
            asyncio.create_task(
                e.update_weights(
                    names,
                    dtypes,
                    shapes,
                    version,
                    load_format,
                    self.group_name,
                    flush,
                    timeout_s=self.timeout_s + 10,
                )
            ): e
            for e in self.engines
        }
        sent = in_daemon_thread(self._broadcast_bucket, tensors, load_format == "flattened_bucket")
        await self._wait_all(calls, sent, self.timeout_s, f"bucket {index} ({len(names)} tensors)")
        return sent.result()

    def _broadcast_bucket(self, tensors: list[torch.Tensor], flattened: bool) -> int:
        """Broadcast one bucket (packed into the staging buffer first when `flattened`, else
        per tensor straight from the learner's own memory); its bytes. Runs in the broadcast's
        own thread, so the engines' HTTP calls go out while it packs: the engines parse them
        and join the broadcast meanwhile. The staging buffer is free: buckets go one at a
        time, each after the previous one's broadcast returned."""
        select_device(self._device)  # a fresh thread: on device 0 until told otherwise
        payload = tensors
        if flattened:
            total = flat_layout([t.dtype for t in tensors], [t.shape for t in tensors])[1]
            payload = [flatten_bucket(tensors, self._staging.get(total, tensors[0].device))]
        broadcast(payload, self._group)
        return sum(tensor_nbytes(t) for t in payload)

    async def _wait_all(self, calls: dict, mine: asyncio.Future, timeout: float, what: str) -> None:
        """Wait for every engine call and our own collective; fail fast, naming engines."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pending = set(calls) | {mine}
        try:
            while pending:
                left = deadline - loop.time()
                done, pending = await asyncio.wait(
                    pending, timeout=max(left, 0), return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    urls = [calls[t].url for t in pending if t in calls] or ["<learner>"]
                    raise self._fail(f"{what}: no reply within {timeout:.0f}s from {urls}", mine)
                for t in done:
                    exc = t.exception()
                    if exc is None:
                        continue
                    if t is mine:
                        culprits = self._culprits(calls, pending, str(exc))
                        raise self._fail(f"{what}: learner side failed ({culprits}): {exc}", mine)
                    problem = _describe(exc)
                    # An engine may refuse a bucket after taking part in the broadcast: let our
                    # own side finish, so the group counts as broken only if it really is.
                    await asyncio.wait({mine}, timeout=max(deadline - loop.time(), 0))
                    raise self._fail(f"{what}: engine {calls[t].url} failed: {problem}", mine)
        finally:
            for t in pending:
                if t is not mine:
                    t.cancel()

    def _culprits(self, calls: dict, pending: set, error: str) -> str:
        """Which engines to blame when our own collective failed.

        Every engine's HTTP call waits for the whole group, so "not replied" names them all;
        a rendezvous timeout lists the store keys still missing (".../<rank>"), which name
        exactly the ranks that never joined. Best effort: falls back to the not-replied list.
        """
        waiting = [calls[c].url for c in pending if c in calls]
        if "keys:" in error and self._offsets:
            ranks = {int(r) for r in re.findall(r"/(\d+)\b", error.split("keys:", 1)[1])}
            never = [url for url, (lo, hi) in self._offsets.items() if ranks & set(range(lo, hi))]
            if never:
                return f"engines that never joined: {never}"
        return f"engines not done: {waiting}" if waiting else "all engines replied"

    def _fail(self, message: str, mine: asyncio.Future) -> WeightSyncError:
        # Our collective still running (or failed) means the group is out of step for good.
        if not mine.done() or mine.exception() is not None:
            self._broken = message
            if not mine.done():
                mine.add_done_callback(lambda t: t.exception())  # silence "never retrieved"
                self._staging = StagingBuffer()  # the stuck broadcast keeps reading the old one
        return WeightSyncError(message)

    async def _control(self, call, what: str) -> None:
        async def one(e: WeightTarget) -> None:
            try:
                await asyncio.wait_for(call(e), self.timeout_s)
            except TimeoutError:  # asyncio's carries no message
                raise WeightSyncError(
                    f"{what} failed on engine {e.url}: no reply within {self.timeout_s:g}s"
                ) from None
            except Exception as exc:  # noqa: BLE001 - any failure of the engine, named
                raise WeightSyncError(
                    f"{what} failed on engine {e.url}: {_describe(exc)}"
                ) from None

        await asyncio.gather(*(one(e) for e in self.engines))


def _describe(exc: BaseException) -> str:
    """What happened, never empty: the engine client's `problem`, else the exception's type
    and the first line of its message."""
    problem = getattr(exc, "problem", None)
    if problem:
        return str(problem)
    text = str(exc).splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else f"{type(exc).__name__} (no message)"

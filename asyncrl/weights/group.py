"""Standalone torch.distributed groups for weight updates (learner rank 0, engines 1..N).

The group is NOT the process-global default group: the learner may already run DDP/FSDP in its
own default group, and an engine may belong to several update groups (one per `group_name`).
Rendezvous goes through a fresh `TCPStore` at `master_address:master_port` hosted by rank 0,
under the key prefixes SGLang's `init_custom_process_group` produces (its store wrapped in
`PrefixStore(group_name)`, then torch's group helper adds `group_name/` and the device).

- gloo: a `ProcessGroupGloo` is built directly on those keys. When the master address is a
  loopback address the gloo device binds to 127.0.0.1 (CI, one host); otherwise the interface
  named by `GLOO_SOCKET_IFNAME`, or else the one on the route to the master (`_gloo_device`).
- nccl / hccl: built through `torch.distributed.distributed_c10d._new_process_group_helper` with
  the same group name, exactly SGLang's route, so the engine side of a real SGLang server and
  this learner side agree. (hccl needs `torch_npu` imported to register itself.)

Every collective goes through `broadcast`, which waits with the group's timeout: a peer that
never joins makes the call raise instead of hanging.

Authentication of the rendezvous: a TCPStore has none (any local process can connect, list,
read and write its keys). A group whose name `sealed_group_name()` made (gloo, every rank an
asyncrl process: the learner and hf engines) seals its store: each value carries an HMAC keyed
by the name's secret part (`SealedStore`), so a process without it cannot forge a rank's
address or any other rendezvous value; a forged value makes the join fail with GroupError
instead of connecting to the forger. The name reaches engines only in the authenticated
`/init_weights_update_group` call. Not covered: reading the (sealed) values, and spam or
deletion on the port (denial of service: the join fails at its timeout). SGLang's engines
build their store themselves (`init_custom_process_group`: a plain `PrefixStore(group_name)`),
so groups with SGLang engines keep that layout; there a secret group name only keeps blind
writers off the keys (`list_keys` reveals it once the first rank joined).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from asyncrl.device import select_device
from asyncrl.net import free_port, route_ip

T = TypeVar("T")

BACKENDS = ("gloo", "nccl", "hccl")
#: Group names starting so are sealed (see the module docstring); the rest is the secret.
SEALED_PREFIX = "asyncrl-sealed-"
_TAG = hashlib.sha256().digest_size


class GroupError(RuntimeError):
    """A weight-update group could not be formed or a collective on it failed."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def rendezvous_port(master_address: str, tries: int = 64) -> int:
    """A port for rank 0's TCPStore (`weight_sync.master_port: 0`): free on `master_address`,
    the address advertised to the engines (multi-node: the node's, not loopback), and on the
    wildcard of its family, since TCPStore's server listens on every interface."""
    wildcard = "::" if ":" in master_address else "0.0.0.0"
    for _ in range(tries):
        port = free_port(master_address)
        if _bindable(wildcard, port):
            return port
    raise GroupError(f"no port free on both {master_address} and {wildcard} in {tries} tries")


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def sealed_group_name() -> str:
    """A fresh group name whose second part (128 random bits) is the group's secret."""
    return SEALED_PREFIX + secrets.token_hex(16)


def shown(group_name: str) -> str:
    """`group_name` for messages and logs: a sealed name's secret left out."""
    return SEALED_PREFIX + "…" if group_name.startswith(SEALED_PREFIX) else group_name


class SealedStore(dist.Store):
    """A store whose values carry HMAC-SHA256(secret, key ‖ 0 ‖ value): `get` returns a value
    only if a holder of the secret wrote it under that key. Counters (`add`) stay plain: a
    forged count can stall a join (denial of service) but never redirect it."""

    def __init__(self, store: dist.Store, secret: bytes) -> None:
        super().__init__()
        self._store, self._secret = store, secret

    def _seal(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + value, hashlib.sha256).digest() + value

    def set(self, key: str, value) -> None:
        self._store.set(key, self._seal(key, _as_bytes(value)))

    def get(self, key: str) -> bytes:
        raw = bytes(self._store.get(key))
        value = raw[_TAG:]
        if not hmac.compare_digest(raw, self._seal(key, value)):
            raise GroupError(
                f"rendezvous value {key!r} failed authentication: written by a process "
                "without the group's secret"
            )
        return value

    def compare_set(self, key: str, expected, desired) -> bytes:
        expected, desired = _as_bytes(expected), _as_bytes(desired)
        sealed = self._seal(key, expected) if expected else b""
        self._store.compare_set(key, sealed, self._seal(key, desired))
        return self.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._store.wait(keys) if timeout is None else self._store.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._store.set_timeout(timeout)

    def clone(self) -> SealedStore:
        """The same sealed store over a new connection (gloo's `new_group` asks for one)."""
        return SealedStore(self._store.clone(), self._secret)

    # torch's C++ trampoline calls these two by their C++ names
    def getNumKeys(self) -> int:  # noqa: N802
        return self._store.num_keys()

    def deleteKey(self, key: str) -> bool:  # noqa: N802
        return self._store.delete_key(key)


def _keep(*_: object) -> None:
    """A finalizer that only holds its arguments until the object it watches is gone."""


def _as_bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _sealed_store(store: dist.Store, group_name: str) -> SealedStore:
    """Keys under a digest of the name (never the secret itself), values sealed with it."""
    digest = hashlib.sha256(b"asyncrl weight-update rendezvous\0" + group_name.encode())
    prefix = hashlib.sha256(b"asyncrl keys\0" + digest.digest()).hexdigest()[:16]
    return SealedStore(dist.PrefixStore(prefix, store), digest.digest())


def sealed_tcp_store(
    host: str, port: int, rank: int, world: int, secret: bytes, timeout: datetime.timedelta
) -> SealedStore:
    """A TCPStore at host:port (rank 0 hosts it) whose values are sealed with `secret`: the
    rendezvous of a learner's ranks across nodes (`learner/placement.py:Rendezvous`)."""
    if len(secret) < 16:
        raise GroupError("a sealed rendezvous needs a secret of at least 16 bytes")
    store = dist.TCPStore(host, port, world, rank == 0, timeout=timeout, wait_for_workers=False)
    digest = hashlib.sha256(b"asyncrl learner rendezvous\0" + secret).digest()
    return SealedStore(dist.PrefixStore("asyncrl-learner", store), digest)


def keep_alive(group: dist.ProcessGroup, store: dist.Store) -> None:
    """Hold `store` as long as `group` lives: torch keeps only the C++ side of a Python store,
    and once the Python object is collected every call into it fails ("Not implemented")."""
    weakref.finalize(group, _keep, store)


def create_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the group; blocks until all `world_size` ranks joined or timeout."""
    if backend not in BACKENDS:
        raise GroupError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if not 0 <= rank < world_size:
        raise GroupError(f"rank {rank} outside world of size {world_size}")
    if group_name.startswith(SEALED_PREFIX) and backend != "gloo":
        raise GroupError(f"a sealed group is gloo only, not {backend}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        if group_name.startswith(SEALED_PREFIX):
            sealed = _sealed_store(store, group_name)
            pg = _gloo_group(sealed, rank, world_size, timeout, master_address)
            # The C++ group does not keep a Python store (nor the TCPStore server it wraps)
            # alive: rank 0 returning first would drop the server under the other ranks.
            keep_alive(pg, sealed)
            return pg
        if backend == "gloo":
            # The keys torch's helper uses for a gloo group made SGLang's way (see
            # _accelerator_group): PrefixStore(name) / "name/" / "cpu/". Same keys, so a
            # gloo SGLang receiver and asyncrl's hf receiver both meet this sender.
            for prefix in (group_name, f"{group_name}/", "cpu/"):
                store = dist.PrefixStore(prefix, store)
            return _gloo_group(store, rank, world_size, timeout, master_address)
        return _accelerator_group(backend, store, rank, world_size, group_name, timeout)
    except GroupError:
        raise
    except Exception as e:  # DistStoreError, gloo/nccl runtime errors: one line for the caller
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GroupError(
            f"rank {rank}/{world_size} could not join group {shown(group_name)!r} at "
            f"{master_address}:{master_port} ({backend}): {msg}"
        ) from e


def _gloo_group(store, rank, world_size, timeout, master_address) -> dist.ProcessGroup:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [_gloo_device(master_address)]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def _gloo_device(master_address: str) -> object:
    """The interface this rank's gloo pairs listen on: loopback for a loopback master (CI, one
    host); `GLOO_SOCKET_IFNAME` when set; else the one on the route to the master (multi-node:
    reachable from the other nodes, unlike a host name that resolves to 127.0.1.1)."""
    if _is_loopback(master_address):
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return dist.ProcessGroupGloo.create_default_device()
    return dist.ProcessGroupGloo.create_device(hostname=route_ip(master_address))


def _accelerator_group(backend, store, rank, world_size, group_name, timeout):
    """Exactly SGLang's `init_custom_process_group` key layout: the rendezvous store wrapped in
    `PrefixStore(group_name)`, then torch's helper with the same `group_name` (it adds its own
    `group_name/` prefix). Any other prefix and the NCCL ids never meet: the sync hangs."""
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    if backend == "hccl":
        import torch_npu  # noqa: F401  registers the hccl backend

    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        dist.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast(tensors: list[torch.Tensor], group: dist.ProcessGroup, src: int = 0) -> None:
    """Broadcast each tensor from `src` in order; raises GroupError on timeout or peer loss.

    All broadcasts are issued before waiting (as SGLang's receiver does), so order on the wire
    is the list order on every rank.
    """
    try:
        _use_device_of(tensors)
        works = []
        for t in tensors:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            opts.rootTensor = 0
            works.append(group.broadcast([t], opts))
        for w in works:
            w.wait()
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GroupError(f"broadcast failed: {msg}") from e


def staging_device(backend: str, learner: torch.device | None) -> torch.device:
    """Where buckets are staged for `backend`, which is also the device rank 0 of the update
    group communicates from: the learner's own device (`learner`, as the learner reports it,
    never read from a thread's state: the control and collective threads never chose one).
    None, or a device of another kind (a learner on the CPU feeding NCCL engines): device 0."""
    kind = {"nccl": "cuda", "hccl": "npu"}.get(backend)
    if kind is None:
        return torch.device("cpu")
    if learner is not None and learner.type == kind:
        return learner if learner.index is not None else torch.device(kind, 0)
    return torch.device(kind, 0)


def on_device(device: torch.device, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` with `device` this thread's current accelerator (`asyncrl.device.
    select_device`; nothing on the CPU). A thread starts on device 0, and NCCL/HCCL create
    their communicator and streams on the current device, as do allocations that name none."""
    select_device(device)
    return fn(*args)


def _use_device_of(tensors: list[torch.Tensor]) -> None:
    """Make the tensors' accelerator this thread's current device (see `on_device`)."""
    if tensors:
        select_device(tensors[0].device)


def destroy_group(group: dist.ProcessGroup) -> None:
    """Best effort: release the group's sockets/communicators."""
    from torch.distributed.distributed_c10d import _world

    # Groups made by torch's helper (nccl/hccl) are registered under their name; destroying
    # them through torch frees the name, so a re-init after a heal may reuse it.
    if group in _world.pg_map:
        try:
            dist.destroy_process_group(group)
            return
        except Exception:  # noqa: BLE001 - fall through to a plain shutdown
            pass
    try:
        if hasattr(group, "shutdown"):
            group.shutdown()
        elif hasattr(group, "abort"):
            group.abort()
    except Exception:  # noqa: BLE001 - teardown of an already broken group may fail; nothing to do
        pass

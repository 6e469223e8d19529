"""The trajectory stream: many ZMQ PUSH senders (`sender.py`), one PULL receiver (here).

Backpressure, never loss. Who buffers what, per sender connection: the sender's libzmq pipe
holds up to `SenderConfig.hwm` messages, the kernel's TCP send and receive buffers hold what
fits, and the receiver's libzmq pipe holds up to `ReceiverConfig.hwm` messages. libzmq's I/O
threads (C++, outside the GIL) move messages along in the background; nothing in Python reads
ahead: a message leaves the receiver's pipe only when `Receiver.get` takes it, and is decoded
then, in the caller's thread. When the consumer stops calling `get`, the receiver's pipe fills,
its I/O thread stops reading that connection, the TCP buffers fill, the sender's pipe fills,
and `Sender.send` blocks up to `send_timeout_s`, then raises `TransportTimeout`. A message
`send` returned for has been queued and will be delivered while both sockets live; nothing is
dropped to make room.

READY handshake: a sender sets ZMQ_IMMEDIATE, so messages are queued only on a connection whose
ZMTP handshake completed (i.e. the receiver's socket is bound and answering), and its
constructor sends a one-frame ping that can only be queued once that is so. A `Sender` that
constructed without `TransportTimeout` has seen its receiver; one started before its receiver
waits for it (up to `ready_timeout_s`). The receiver counts pings and discards them.

Sockets close with linger=0 so no process hangs on exit behind a dead peer; messages still queued
in a closing sender's pipe, or not yet taken from a closing receiver's, are discarded. The
receiver binds 127.0.0.1 unless `host` says otherwise; port 0 picks a free port (see
`Receiver.address`).

Authentication, per connection (`auth.py`): with the run's `secret`, the receiver's socket is a
ZMTP PLAIN server (it binds loopback) or CURVE server (any other address), whose handshakes a
ZAP handler checks against the secret; a sender proves it in its handshake. libzmq reads no
message of a connection whose handshake failed, so a process without the secret delivers
nothing, not even a READY ping (its `Sender` times out as if no receiver were there); its
refused handshakes are counted (`unauthenticated`). Messages carry no extra frame or byte.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import zmq

from asyncrl.transport.auth import ConnectionGate, Credentials, needs_curve
from asyncrl.transport.batch import decode_groups
from asyncrl.transport.codec import MAX_FRAMES, MAX_MESSAGE_BYTES, DecodeError, encode_arrays

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The handshake ping: a header-only codec message of kind "ping".
PING = bytes(encode_arrays({}, kind="ping")[0])


class TransportTimeout(TimeoutError):
    """A send or receive did not complete in time (receiver full, gone, or not up yet)."""


class ReceiverError(RuntimeError):
    """The receiver stopped (closed, or broken by a failed `decode`); raised by `get`."""


@dataclass
class ReceiverConfig:
    host: str = "127.0.0.1"  # "0.0.0.0" (or an interface address) for multi-node runs
    port: int = 0  # 0: a free port, see Receiver.port
    hwm: int = 64  # messages libzmq buffers per connected sender before that sender blocks
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_frames: int = MAX_FRAMES
    poll_interval_s: float = 0.05  # how often a waiting `get` looks whether `close` was called
    # The run's secret: only connections whose handshake proves it are read. None: no
    # authentication (tests, benches). Never printed (repr=False).
    secret: bytes | None = field(default=None, repr=False)
    # CURVE (encrypted) or PLAIN; None: `needs_curve(host)`, CURVE unless `host` is loopback.
    curve: bool | None = None


@dataclass(frozen=True)
class ReceiverStats:
    received: int  # records decoded (a batch message counts each of its groups)
    rejected: int  # messages that failed to decode (dropped, reason logged)
    bytes: int  # bytes of every message read off the socket, rejected ones included
    pings: int  # READY pings seen
    unauthenticated: int  # connections refused at the handshake (nothing of theirs was read)
    last_error: str | None  # reason of the latest rejection or refusal


class Receiver(Generic[T]):
    """One PULL socket; `get` receives and decodes the next message in the caller's thread.

    There is no Python receiver thread: libzmq's I/O thread (C++, no GIL) reads the sockets in
    the background and buffers up to `hwm` messages per sender, so a consumer never competes
    for the GIL with a second Python thread (measured: that contention tripled decode cost).

    `decode(frames)` must return the record or raise DecodeError (default: `decode_group` with
    this config's limits). A DecodeError rejects the message: counted, one-line reason logged,
    dropped, and `get` goes on to the next one. Any other exception from `decode` propagates
    from that `get` unchanged; the message is lost, so the receiver is then broken: every later
    `get` raises ReceiverError (chained to it). Senders see backpressure, as with a stalled
    consumer.

    Threads: `get` from one thread at a time (a lock serialises callers); `stats()` and
    `close()` from any thread. `close` waits for an in-flight `get`, which notices it within
    `poll_interval_s`.

    With `config.secret`, a ZAP handler thread (`auth.ConnectionGate`) checks every connection's
    handshake; a refused one is counted in `unauthenticated` (logged at the 1st, 2nd, 4th, ...
    so a flood cannot flood the log) and none of its messages is ever read.
    """

    def __init__(
        self,
        config: ReceiverConfig,
        decode: Callable[[list[zmq.Frame]], T] | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.config = config
        # One message may hold several records (a batch of groups): `_decode_many` returns
        # them all; `get` hands them out one by one from `_pending`, in order.
        self._decode_many: Callable[[list[zmq.Frame]], list[Any]] = (
            self._decode_groups if decode is None else lambda frames: [decode(frames)]
        )
        self._pending: deque[Any] = deque()
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._get_lock = threading.Lock()  # guards the socket: zmq sockets are not thread-safe
        self._stats_lock = threading.Lock()
        self._counts = {"received": 0, "rejected": 0, "bytes": 0, "pings": 0}
        self._counts["unauthenticated"] = 0
        self._last_error: str | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self._timeout_ms = -1  # libzmq's RCVTIMEO default: block
        self._gate: ConnectionGate | None = None
        self._socket = self._bind()

    def _bind(self) -> zmq.Socket:
        cfg = self.config
        sock = self._context.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, cfg.hwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, int(":" in cfg.host))
        # A frame over the limit makes libzmq drop that peer's connection before buffering it
        # (a memory guard); a well-behaved Sender with the same limit never sends one.
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
        self.address = tcp_endpoint(cfg.host, "*" if cfg.port == 0 else cfg.port)
        curve = needs_curve(cfg.host) if cfg.curve is None else cfg.curve
        try:
            if cfg.secret is not None:  # the gate answers before any peer can handshake
                credentials = Credentials.from_secret(cfg.secret)
                credentials.secure_server(sock, curve)
                self._gate = ConnectionGate(self._context, sock, credentials, self._refused)
            sock.bind(self.address)
        except (zmq.ZMQError, RuntimeError, ValueError) as e:
            self._close_socket(sock)
            if isinstance(e, zmq.ZMQError):
                raise OSError(f"cannot bind {cfg.host}:{cfg.port}: {e}") from None
            raise
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(self.address.rsplit(":", 1)[1])
        return sock

    def _decode_groups(self, frames: list[zmq.Frame]) -> list[Any]:
        cfg = self.config
        return decode_groups(frames, max_bytes=cfg.max_message_bytes, max_frames=cfg.max_frames)

    def get(self, timeout_s: float | None = None) -> T:
        """The next record; TransportTimeout after `timeout_s` (None: wait forever);
        ReceiverError once the receiver is closed or broken. Pings and rejected messages are
        skipped within the same deadline. A custom `decode`'s non-DecodeError propagates."""
        if self._pending and self._get_lock.acquire(blocking=False):
            try:  # the rest of a batch, already decoded and counted: no deadline to keep
                if self._pending and self._failure is None and not self._closed:
                    return self._pending.popleft()
            finally:
                self._get_lock.release()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        wait = -1 if timeout_s is None else max(0.0, timeout_s)
        if not self._get_lock.acquire(timeout=wait):
            raise TransportTimeout(f"no record on {self.address} within {timeout_s}s")
        try:
            while True:
                self._check_open()
                if self._pending:  # the rest of a batch already decoded and counted
                    return self._pending.popleft()
                frames = self._recv(deadline, timeout_s)
                if frames is not None:
                    self._handle(frames)
        finally:
            self._get_lock.release()

    def _check_open(self) -> None:
        failure = self._failure
        if failure is not None:
            raise ReceiverError(f"receiver {self.address} failed: {failure!r}") from failure
        if self._closed:
            raise ReceiverError(f"receiver {self.address} is closed")

    def _recv(self, deadline: float | None, timeout_s: float | None) -> list[zmq.Frame] | None:
        """One message, or None after waiting at most `poll_interval_s` (to look at the closed
        flag again). One blocking call per message, bounded by RCVTIMEO; the option is set only
        when the bound changes (near the deadline), not per message. At or past the deadline it
        still takes a message libzmq already holds (RCVTIMEO 0), so `get(timeout_s=0)` polls."""
        wait = self.config.poll_interval_s
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
        timeout_ms = max(0, math.ceil(wait * 1000))
        if timeout_ms != self._timeout_ms:
            self._socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._timeout_ms = timeout_ms
        try:
            return self._socket.recv_multipart(copy=False)
        except zmq.Again:
            if deadline is not None and time.monotonic() >= deadline:
                raise TransportTimeout(f"no record on {self.address} within {timeout_s}s") from None
            return None

    def _handle(self, frames: list[zmq.Frame]) -> None:
        """Decode one message into `_pending` (all its records, or none: a ping, a rejection)."""
        nbytes = sum(len(f) for f in frames)
        if len(frames) == 1 and frames[0].bytes == PING:
            self._count(nbytes, "pings")
            return
        try:
            records = self._decode_many(frames)
        except DecodeError as e:
            self._count(nbytes, "rejected", error=str(e))
            log.warning("rejected message on %s: %s", self.address, e)
            return
        except BaseException as e:  # a decoder bug: this message is lost, say so from now on
            log.error("receiver %s failed: %r", self.address, e)
            self._failure = e
            raise
        self._count(nbytes, "received", records=len(records))
        self._pending.extend(records)

    def _refused(self, reason: str) -> None:
        """A handshake the gate refused (called from its thread)."""
        with self._stats_lock:
            self._counts["unauthenticated"] += 1
            self._last_error = f"unauthenticated: {reason}"
            count = self._counts["unauthenticated"]
        if count & (count - 1) == 0:
            log.warning("refused connection #%d on %s: %s", count, self.address, reason)

    def _count(self, nbytes: int, counter: str, error: str | None = None, records: int = 1) -> None:
        with self._stats_lock:
            self._counts[counter] += records
            self._counts["bytes"] += nbytes
            if error is not None:
                self._last_error = error

    def stats(self) -> ReceiverStats:
        with self._stats_lock:
            return ReceiverStats(**self._counts, last_error=self._last_error)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop: later `get`s raise ReceiverError; messages still buffered are discarded."""
        self._closed = True
        # The socket is closed by whoever holds the get lock last; an in-flight get wakes
        # within poll_interval_s, sees the flag and lets go.
        if not self._get_lock.acquire(timeout=timeout_s):
            log.warning("receiver %s: a get did not return within %ss", self.address, timeout_s)
            return
        try:
            self._close_socket(self._socket)
        finally:
            self._get_lock.release()

    def _close_socket(self, sock: zmq.Socket) -> None:
        """Close `sock`, then the gate, then the context if it is ours (and nothing is left in
        it: `term` waits for every socket of the context)."""
        if not sock.closed:
            sock.close(linger=0)
        stopped = self._gate is None or self._gate.close()
        if not stopped:
            log.warning(
                "receiver %s: the ZAP handler did not stop; context left open", self.address
            )
        if stopped and self._own_context and not self._context.closed:
            self._context.term()

    def __enter__(self) -> Receiver[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tcp_endpoint(host: str, port: int | str) -> str:
    """The ZMQ endpoint of `host:port`, an IPv6 literal in brackets (the rule of `net.url_host`,
    which the transport, below `net` in the layering, cannot import)."""
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{host}:{port}"

"""The trajectory stream: many ZMQ PUSH senders, one PULL receiver.

Backpressure, never loss: each connection buffers at most `Sender.hwm` messages on the sender
side and `Receiver.hwm` on the receiver side (plus what the kernel's TCP buffers hold); when
they are full, `Sender.send` blocks up to `send_timeout_s` and then raises `TransportTimeout`.
A message `send` returned for has been queued and will be delivered while both sockets live;
nothing is dropped to make room. The receiver's decoded-record queue is bounded too, so a
consumer that stops calling `get` stalls the receiver thread, which stops reading, which fills
the HWMs and blocks the senders.

READY handshake: a sender sets ZMQ_IMMEDIATE, so messages are queued only on a connection whose
ZMTP handshake completed (i.e. the receiver's socket is bound and answering), and its
constructor sends a one-frame ping that can only be queued once that is so. A `Sender` that
constructed without `TransportTimeout` has seen its receiver; one started before its receiver
waits for it (up to `ready_timeout_s`). The receiver counts pings and discards them.

Sockets close with linger=0 so no process hangs on exit behind a dead peer; messages still queued
in a closing sender's pipe are discarded. The receiver binds 127.0.0.1 unless `host` says
otherwise; port 0 picks a free port (see `Receiver.address`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import zmq

from asyncrl.transport.codec import (
    MAX_FRAMES,
    MAX_MESSAGE_BYTES,
    DecodeError,
    EncodeError,
    decode_group,
    encode_arrays,
    encode_group,
    message_nbytes,
)
from asyncrl.types import TrajectoryGroup

log = logging.getLogger(__name__)
T = TypeVar("T")

#: `timeout_s` default of the send methods: use the config's `send_timeout_s`.
USE_CONFIG = -1.0
#: The handshake ping: a header-only codec message of kind "ping".
PING = bytes(encode_arrays({}, kind="ping")[0])


class TransportTimeout(TimeoutError):
    """A send or receive did not complete in time (receiver full, gone, or not up yet)."""


class ReceiverError(RuntimeError):
    """The receiver stopped (closed, or its thread failed); raised in the consumer's `get`."""


@dataclass
class SenderConfig:
    host: str = "127.0.0.1"
    port: int = 5555
    hwm: int = 64  # messages queued on this sender's side before `send` blocks
    send_timeout_s: float | None = 30.0  # None: block until there is room
    ready_timeout_s: float | None = 60.0  # None: wait for the receiver forever
    max_message_bytes: int = MAX_MESSAGE_BYTES


@dataclass
class ReceiverConfig:
    host: str = "127.0.0.1"  # "0.0.0.0" (or an interface address) for multi-node runs
    port: int = 0  # 0: a free port, see Receiver.port
    hwm: int = 64  # messages buffered per connected sender before senders block
    queue_size: int = 64  # decoded records waiting for `get`
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_frames: int = MAX_FRAMES
    poll_interval_s: float = 0.05  # how often the thread looks at its stop flag


@dataclass(frozen=True)
class ReceiverStats:
    received: int  # records decoded and queued
    rejected: int  # messages that failed to decode (dropped, reason logged)
    bytes: int  # bytes of every message read off the socket, rejected ones included
    pings: int  # READY pings seen
    last_error: str | None  # reason of the latest rejection


class Sender:
    """One PUSH socket connected to a receiver. Not thread-safe: one Sender per thread."""

    def __init__(self, config: SenderConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        self.address = f"tcp://{_url_host(config.host)}:{config.port}"
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, config.hwm)
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IPV6, int(":" in config.host))
        self._timeout_ms = -1  # libzmq's SNDTIMEO default: block
        self.sent = 0
        self.bytes_sent = 0
        try:
            self._socket.connect(self.address)
            self._send([PING], config.ready_timeout_s, "receiver did not become ready")
        except BaseException:
            self.close()
            raise

    def send(self, group: TrajectoryGroup, timeout_s: float | None = USE_CONFIG) -> int:
        """Encode and queue one group; returns its size in bytes. Blocks while the queue is full
        and raises TransportTimeout after `timeout_s` (default: the config's). Arrays are sent
        zero-copy: do not mutate the group's arrays afterwards."""
        frames = encode_group(group, max_bytes=self.config.max_message_bytes)
        return self.send_frames(frames, timeout_s)

    def send_frames(self, frames: Sequence[Any], timeout_s: float | None = USE_CONFIG) -> int:
        """Queue an already encoded message (list of buffers) as one multipart message."""
        nbytes = message_nbytes(frames)
        if nbytes > self.config.max_message_bytes:
            raise EncodeError(f"message of {nbytes} bytes exceeds {self.config.max_message_bytes}")
        timeout = self.config.send_timeout_s if timeout_s == USE_CONFIG else timeout_s
        self._send(frames, timeout, "send blocked: receiver full, stalled or gone")
        self.sent += 1
        self.bytes_sent += nbytes
        return nbytes

    def _send(self, frames: Sequence[Any], timeout_s: float | None, why: str) -> None:
        # SNDTIMEO bounds the wait for HWM room; libzmq checks the HWM on a message's first
        # frame only, so a multipart message is either queued whole or not at all.
        timeout_ms = -1 if timeout_s is None else int(timeout_s * 1000)
        if timeout_ms != self._timeout_ms:
            self._socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
            self._timeout_ms = timeout_ms
        try:
            self._socket.send_multipart(frames, copy=False)
        except zmq.Again:
            raise TransportTimeout(
                f"{why} ({self.address}, hwm={self.config.hwm}, waited {timeout_s}s)"
            ) from None

    def close(self) -> None:
        if not self._socket.closed:
            self._socket.close(linger=0)
        if self._own_context and not self._context.closed:
            self._context.term()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Receiver(Generic[T]):
    """One PULL socket and a thread that decodes each message into a bounded queue.

    `decode(frames)` must return the record or raise DecodeError (default: `decode_group` with
    this config's limits). A DecodeError rejects the message: counted, one-line reason logged,
    dropped; good messages keep flowing. Any other exception stops the thread and is re-raised
    from the consumer's next `get` as ReceiverError (after the records already queued).
    """

    def __init__(
        self,
        config: ReceiverConfig,
        decode: Callable[[list[zmq.Frame]], T] | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.config = config
        self._decode = decode or self._decode_group
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._queue: queue.Queue[T] = queue.Queue(maxsize=config.queue_size)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._counts = {"received": 0, "rejected": 0, "bytes": 0, "pings": 0}
        self._last_error: str | None = None
        self._failure: BaseException | None = None
        self._socket = self._bind()
        self._thread = threading.Thread(target=self._run, name="asyncrl-receiver", daemon=True)
        self._thread.start()

    def _bind(self) -> zmq.Socket:
        sock = self._context.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, self.config.hwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, int(":" in self.config.host))
        # A frame over the limit makes libzmq drop that peer's connection before buffering it
        # (a memory guard); a well-behaved Sender with the same limit never sends one.
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        port = "*" if self.config.port == 0 else str(self.config.port)
        try:
            sock.bind(f"tcp://{_url_host(self.config.host)}:{port}")
        except zmq.ZMQError as e:
            sock.close(linger=0)
            if self._own_context:
                self._context.term()
            raise OSError(f"cannot bind {self.config.host}:{self.config.port}: {e}") from None
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(self.address.rsplit(":", 1)[1])
        return sock

    def _decode_group(self, frames: list[zmq.Frame]) -> Any:
        cfg = self.config
        return decode_group(frames, max_bytes=cfg.max_message_bytes, max_frames=cfg.max_frames)

    # -- receiver thread ----------------------------------------------------------------------
    def _run(self) -> None:
        # A receive timeout instead of a poll per message: one call per message on the hot path,
        # and the stop flag is still looked at every poll interval.
        self._socket.setsockopt(zmq.RCVTIMEO, max(1, int(self.config.poll_interval_s * 1000)))
        try:
            while not self._stop.is_set():
                try:
                    frames = self._socket.recv_multipart(copy=False)
                except zmq.Again:
                    continue
                self._handle(frames)
        except BaseException as e:  # surfaced to the consumer by `get`
            if not self._stop.is_set():
                log.error("receiver %s failed: %r", self.address, e)
                self._failure = e
        finally:
            self._socket.close(linger=0)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        nbytes = sum(len(f) for f in frames)
        if len(frames) == 1 and frames[0].bytes == PING:
            self._count(nbytes, "pings")
            return
        try:
            record = self._decode(frames)
        except DecodeError as e:
            self._count(nbytes, "rejected", error=str(e))
            log.warning("rejected message on %s: %s", self.address, e)
            return
        self._put(record)
        self._count(nbytes, "received")

    def _put(self, record: T) -> None:
        # Blocking here (a full queue) is the backpressure path: we stop reading the socket.
        while not self._stop.is_set():
            try:
                self._queue.put(record, timeout=self.config.poll_interval_s)
                return
            except queue.Full:
                continue

    def _count(self, nbytes: int, counter: str, error: str | None = None) -> None:
        with self._lock:
            self._counts[counter] += 1
            self._counts["bytes"] += nbytes
            if error is not None:
                self._last_error = error

    # -- consumer side ------------------------------------------------------------------------
    def get(self, timeout_s: float | None = None) -> T:
        """The next record; TransportTimeout after `timeout_s` (None: wait forever);
        ReceiverError once the receiver is closed or broken and its queue is empty."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            stopped = self._failure is not None or self._stop.is_set()
            if stopped or (left is not None and left <= 0):
                try:  # records already decoded are delivered even after a failure
                    return self._queue.get_nowait()
                except queue.Empty:
                    if stopped:
                        raise ReceiverError(self._why_stopped()) from self._failure
                    raise TransportTimeout(
                        f"no record on {self.address} within {timeout_s}s"
                    ) from None
            try:  # wake at least every poll interval to notice a failed or closed receiver
                wait = self.config.poll_interval_s
                return self._queue.get(timeout=wait if left is None else min(wait, left))
            except queue.Empty:
                continue

    def _why_stopped(self) -> str:
        if self._failure is not None:
            return f"receiver {self.address} failed: {self._failure!r}"
        return f"receiver {self.address} is closed"

    def stats(self) -> ReceiverStats:
        with self._lock:
            return ReceiverStats(**self._counts, last_error=self._last_error)

    def qsize(self) -> int:
        return self._queue.qsize()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        if self._own_context and not self._thread.is_alive() and not self._context.closed:
            self._context.term()

    def __enter__(self) -> Receiver[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _url_host(host: str) -> str:
    """IPv6 literals go in brackets in a ZMQ tcp:// endpoint."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host

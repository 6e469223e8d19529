"""The trajectory stream's sending side: one ZMQ PUSH socket per rollout worker thread.

What a send guarantees (backpressure, never loss), the READY handshake and the connection's
authentication are the channel's, described with the receiver in `zmq.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from asyncrl.transport.auth import Credentials, needs_curve
from asyncrl.transport.batch import BATCH_BYTES, chunk_groups, encode_groups
from asyncrl.transport.codec import MAX_MESSAGE_BYTES, EncodeError, encode_group, message_nbytes
from asyncrl.transport.zmq import PING, TransportTimeout, tcp_endpoint
from asyncrl.types import TrajectoryGroup

#: `timeout_s` default of the send methods: use the config's `send_timeout_s`.
USE_CONFIG = -1.0


@dataclass
class SenderConfig:
    host: str = "127.0.0.1"
    port: int = 5555
    hwm: int = 64  # messages queued on this sender's side before `send` blocks
    send_timeout_s: float | None = 30.0  # None: block until there is room
    ready_timeout_s: float | None = 60.0  # None: wait for the receiver forever
    max_message_bytes: int = MAX_MESSAGE_BYTES
    # The run's secret, proven in the handshake. None: no credentials (the receiver must have
    # no secret either). Never printed (repr=False).
    secret: bytes | None = field(default=None, repr=False)
    # CURVE or PLAIN, as the receiver uses: None picks what a receiver bound to `host` would
    # (`needs_curve`); a sender reaching through loopback a receiver bound to 0.0.0.0 says True.
    curve: bool | None = None


class Sender:
    """One PUSH socket connected to a receiver. Not thread-safe: one Sender per thread."""

    def __init__(self, config: SenderConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        self.address = tcp_endpoint(config.host, config.port)
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
            if config.secret is not None:
                curve = needs_curve(config.host) if config.curve is None else config.curve
                Credentials.from_secret(config.secret).secure_client(self._socket, curve)
            self._socket.connect(self.address)
            why = "receiver did not become ready (not up, or it refused this sender's secret)"
            self._send([PING], config.ready_timeout_s, why)
        except BaseException:
            self.close()
            raise

    def send(self, group: TrajectoryGroup, timeout_s: float | None = USE_CONFIG) -> int:
        """Encode and queue one group; returns its size in bytes. Blocks while the queue is full
        and raises TransportTimeout after `timeout_s` (default: the config's). Arrays are sent
        zero-copy: do not mutate the group's arrays afterwards."""
        frames = encode_group(group, max_bytes=self.config.max_message_bytes)
        return self.send_frames(frames, timeout_s)

    def send_many(
        self, groups: Sequence[TrajectoryGroup], timeout_s: float | None = USE_CONFIG
    ) -> int:
        """Encode and queue `groups` (a sender's backlog) as few messages as the size limit
        allows, in order; returns their bytes. A batch is queued whole or not at all: on
        TransportTimeout none of the groups of the message that timed out was sent (earlier
        messages were). Same zero-copy caveat as `send`."""
        total = 0
        for chunk in chunk_groups(groups, min(BATCH_BYTES, self.config.max_message_bytes // 2)):
            frames = encode_groups(chunk, max_bytes=self.config.max_message_bytes)
            total += self.send_frames(frames, timeout_s)
        return total

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

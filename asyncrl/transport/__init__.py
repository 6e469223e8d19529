"""Transport: the wire codec (msgpack header + raw side buffers), the ZMQ PUSH/PULL channel and
its connection authentication (ZMTP PLAIN or CURVE, keyed by the run's secret)."""

from asyncrl.transport.auth import Credentials, needs_curve
from asyncrl.transport.codec import (
    DecodeError,
    EncodeError,
    decode_arrays,
    decode_group,
    encode_arrays,
    encode_group,
)
from asyncrl.transport.zmq import (
    Receiver,
    ReceiverConfig,
    ReceiverError,
    ReceiverStats,
    Sender,
    SenderConfig,
    TransportTimeout,
)

__all__ = [
    "Credentials",
    "DecodeError",
    "EncodeError",
    "Receiver",
    "ReceiverConfig",
    "ReceiverError",
    "ReceiverStats",
    "Sender",
    "SenderConfig",
    "TransportTimeout",
    "decode_arrays",
    "decode_group",
    "encode_arrays",
    "encode_group",
    "needs_curve",
]

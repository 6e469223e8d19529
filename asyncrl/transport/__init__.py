"""Transport: the wire codec (msgpack header + raw side buffers) and the ZMQ PUSH/PULL channel."""

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
]

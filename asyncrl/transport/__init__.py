"""Transport: the wire codec (msgpack header + raw side buffers; one group, or a sender's backlog
batched in one message), the ZMQ PUSH/PULL channel and its connection authentication (ZMTP
PLAIN or CURVE, keyed by the run's secret)."""

from asyncrl.transport.auth import Credentials, needs_curve
from asyncrl.transport.batch import BATCH_KIND, decode_groups, encode_batch, encode_groups
from asyncrl.transport.batcher import SendBatcher
from asyncrl.transport.codec import (
    DecodeError,
    EncodeError,
    decode_arrays,
    decode_group,
    encode_arrays,
    encode_group,
)
from asyncrl.transport.sender import Sender, SenderConfig
from asyncrl.transport.zmq import (
    Receiver,
    ReceiverConfig,
    ReceiverError,
    ReceiverStats,
    TransportTimeout,
)

__all__ = [
    "BATCH_KIND",
    "Credentials",
    "DecodeError",
    "EncodeError",
    "Receiver",
    "ReceiverConfig",
    "ReceiverError",
    "ReceiverStats",
    "SendBatcher",
    "Sender",
    "SenderConfig",
    "TransportTimeout",
    "decode_arrays",
    "decode_group",
    "decode_groups",
    "encode_arrays",
    "encode_batch",
    "encode_group",
    "encode_groups",
    "needs_curve",
]

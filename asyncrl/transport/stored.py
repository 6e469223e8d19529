"""Trajectory groups at rest (the replay queue's contents in checkpoints), in exactly the
wire codec's frames, so the wire and the checkpoint cannot drift apart.

A stored group: magic, frame count, each frame's length (all little-endian u64), then the
frames of `encode_group` in order, each zero-padded to a multiple of 8 bytes so that arrays
decoded from 8-aligned data are aligned. The magic names the container format only; the
header frame inside still carries SCHEMA_VERSION, checked by `decode_group` as on the wire.
"""

from __future__ import annotations

import struct
from typing import Any

from asyncrl.transport.codec import (
    MAX_FRAMES,
    MAX_MESSAGE_BYTES,
    DecodeError,
    decode_group,
    encode_group,
)
from asyncrl.types import TrajectoryGroup

_STORED_MAGIC = b"ARLGRP\x00\x01"
_U64 = struct.Struct("<Q")
_PAD = bytes(8)


def group_to_bytes(
    group: TrajectoryGroup, *, max_bytes: int = MAX_MESSAGE_BYTES, max_frames: int = MAX_FRAMES
) -> bytes:
    """One TrajectoryGroup as bytes at rest: exactly `encode_group`'s frames, length-prefixed
    (EncodeError as there). `group_from_bytes` reads them back."""
    encoded = encode_group(group, max_bytes=max_bytes, max_frames=max_frames)
    frames = [memoryview(f).cast("B") for f in encoded]
    parts: list[Any] = [_STORED_MAGIC, _U64.pack(len(frames))]
    parts += [_U64.pack(f.nbytes) for f in frames]
    for f in frames:
        parts += (f, _PAD[: -f.nbytes % 8])
    return b"".join(parts)


def group_from_bytes(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = MAX_MESSAGE_BYTES,
    max_frames: int = MAX_FRAMES,
) -> TrajectoryGroup:
    """The TrajectoryGroup that `group_to_bytes` stored, validated by `decode_group` exactly as
    one off the wire, or DecodeError. Its arrays are views of `data`, not copies (read-only
    when `data` is bytes)."""
    frames = _stored_frames(data, max_frames)
    return decode_group(frames, max_bytes=max_bytes, max_frames=max_frames)


def _stored_frames(data: bytes | bytearray | memoryview, max_frames: int) -> list[memoryview]:
    """The frames in a stored group, every length and byte of the container accounted for."""
    try:
        view = memoryview(data).cast("B")
    except (TypeError, ValueError, BufferError):
        raise DecodeError(f"a stored group is bytes, got {type(data).__name__}") from None
    if view.nbytes < 16 or view[:8] != _STORED_MAGIC:
        raise DecodeError(f"not a stored trajectory group (starts {bytes(view[:8])!r})")
    (count,) = _U64.unpack_from(view, 8)
    if count > max_frames:  # before reading `count` lengths: a garbage count is huge
        raise DecodeError(f"stored group has {count} frames, limit is {max_frames}")
    pos = 16 + 8 * count
    if pos > view.nbytes:
        raise DecodeError(f"stored group is truncated: {view.nbytes} bytes, its table needs {pos}")
    frames = []
    for i, (length,) in enumerate(_U64.iter_unpack(view[16:pos])):
        end = pos + length
        padded = end + -length % 8
        if padded > view.nbytes:
            raise DecodeError(
                f"stored group is truncated: frame {i} needs {padded - pos} bytes at offset "
                f"{pos}, {view.nbytes - pos} left"
            )
        if any(view[end:padded]):  # the writer pads with zeros: anything else is corruption
            raise DecodeError(f"stored group: padding after frame {i} is not zero")
        frames.append(view[pos:end])
        pos = padded
    if pos != view.nbytes:
        raise DecodeError(f"stored group has {view.nbytes - pos} bytes after its last frame")
    return frames

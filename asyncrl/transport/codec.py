"""Wire codec: a msgpack header plus the arrays as raw side buffers (vLLM v1's layout).

A message is a list of frames. Frame 0 is a msgpack header, the array `[schema, kind, arrays,
fields]`: `schema` is `SCHEMA_VERSION`, `kind` names the record (`"trajectory_group"`, or any
name given to `encode_arrays`), `arrays` maps each array's name to `[lib, dtype, shape, frame]`
and `fields` holds the plain values (str, int, float, bool, None, bytes, lists, str-keyed maps).
Frames 1.. are the arrays' bytes, C order, little-endian, one frame per array, sent with
`send_multipart(copy=False)` so large arrays are never copied into a Python bytes object.

Decoding is typed and total: every input either yields a complete, validated record or raises
one `DecodeError` with the reason. Nothing is unpickled: the header is plain msgpack decoded by
msgspec against a fixed schema, extension types are refused, and array dtypes come from a fixed
allowlist (no object dtypes). The header library is msgspec: it measured faster than the
`msgpack` package on these headers (bench/codec_choice.py, bench/results/codec_choice.json).

Several groups in one message (kind `"trajectory_batch"`, same schema version: the layout above
with the groups' arrays concatenated and per-group lists in `fields`) are `batch.py`'s.

At rest (checkpoints of the replay queue), a group is stored as the very same frames, length
prefixed (`group_to_bytes`, `group_from_bytes`), and read back through `decode_group`: the wire
and the stored format cannot drift apart.

numpy arrays decode as read-only or frame-backed numpy views (no copy); torch tensors (any
dtype in `TORCH_DTYPES`, bfloat16 and float8 included) decode as torch tensors, importing torch
only when one arrives. This module imports neither torch nor Ray at load time.

The arrays' side of it (frames ↔ arrays, dtypes, limits, the errors) is `frames.py`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from asyncrl.transport.frames import (
    BYTE,
    GROUP_ARRAYS,
    MAX_FRAMES,
    MAX_HEADER_BYTES,
    MAX_MESSAGE_BYTES,
    NUMPY_DTYPES,
    TORCH_DTYPES,
    WIRE_NAME,
    ArraySpec,
    DecodeError,
    EncodeError,
    check_sizes,
    export_array,
    frame_views,
    import_arrays,
    import_group_arrays,
)
from asyncrl.types import RecordError, TrajectoryGroup

# The wire's errors, limits and dtypes are `frames.py`'s; named here too, as the codec's API.
__all__ = ["MAX_FRAMES", "MAX_HEADER_BYTES", "MAX_MESSAGE_BYTES", "NUMPY_DTYPES", "TORCH_DTYPES"]
__all__ += ["DecodeError", "EncodeError", "decode_arrays", "decode_group", "encode_arrays"]
__all__ += ["encode_group", "message_nbytes", "GROUP_KIND", "SCHEMA_VERSION"]
SCHEMA_VERSION = 1
GROUP_KIND = "trajectory_group"
_MAX_DEPTH = 32  # nesting of plain values in `fields`


class _Header(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    schema: int
    kind: str
    arrays: dict[str, ArraySpec]
    fields: dict[str, Any]


class _GroupFields(msgspec.Struct, forbid_unknown_fields=True):
    group_id: str
    finish_reasons: list[str]
    metadata: dict[str, Any]


class _GroupHeader(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A TrajectoryGroup's header: the same layout as `_Header`, with `fields` typed."""

    schema: int
    kind: str
    arrays: dict[str, ArraySpec]
    fields: _GroupFields


# Exact types of plain scalars: one set lookup settles the common case in `_plain_problem`.
_SCALARS = frozenset({type(None), bool, int, float, str, bytes})


def _enc_hook(value: Any) -> Any:
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value.item()
    raise TypeError(f"cannot encode {type(value).__name__}")


def _refuse_ext(code: int, data: memoryview) -> Any:
    raise DecodeError(f"msgpack extension type {code} is not allowed")


# Stateless, immutable configuration objects (each call keeps its state on the C stack), so
# sharing them between threads is safe; they are constants, not mutable singletons.
_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_HEADER_DECODER = msgspec.msgpack.Decoder(_Header, ext_hook=_refuse_ext)
_GROUP_DECODER = msgspec.msgpack.Decoder(_GroupHeader, ext_hook=_refuse_ext)
_ANY_DECODER = msgspec.msgpack.Decoder(ext_hook=_refuse_ext)


# -- encode -------------------------------------------------------------------------------------
def encode_arrays(
    arrays: Mapping[str, Any],
    fields: Mapping[str, Any] | None = None,
    *,
    kind: str = "arrays",
    max_bytes: int = MAX_MESSAGE_BYTES,
    max_frames: int = MAX_FRAMES,
) -> list[Any]:
    """Frames for a message of named arrays (numpy or torch) plus plain `fields`.

    Frame 0 is the header (bytes); the others are buffers that alias the arrays' memory when
    they are already contiguous little-endian CPU arrays: do not mutate them until sent.
    """
    fields = dict(fields or {})
    if problem := _plain_problem(fields, "fields", 0, encoding=True):
        raise EncodeError(problem)
    return _encode(arrays, fields, kind, max_bytes, max_frames)


def encode_group(
    group: TrajectoryGroup, *, max_bytes: int = MAX_MESSAGE_BYTES, max_frames: int = MAX_FRAMES
) -> list[Any]:
    """Frames for one TrajectoryGroup: a header and one frame per array field (8, one more
    with advantages, one more with routes)."""
    arrays = {name: getattr(group, name) for name in GROUP_ARRAYS}
    if arrays["advantages"] is None:
        del arrays["advantages"]
    if group.routes is not None:  # 2-D uint8 (`frames.ROUTES`): its shape travels in the spec
        arrays["routes"] = group.routes
    # Only what the record's own validation does not already guarantee is checked here.
    if not isinstance(group.group_id, str) or not all(type(r) is str for r in group.finish_reasons):
        raise EncodeError("group_id and finish_reasons must be str")
    if problem := _plain_problem(group.metadata, "metadata", 1, encoding=True):
        raise EncodeError(problem)
    fields = {
        "group_id": group.group_id,
        "finish_reasons": group.finish_reasons,
        "metadata": group.metadata,
    }
    return _encode(arrays, fields, GROUP_KIND, max_bytes, max_frames)


def _encode(
    arrays: Mapping[str, Any], fields: dict[str, Any], kind: str, max_bytes: int, max_frames: int
) -> list[Any]:
    specs: dict[str, list[Any]] = {}
    frames: list[Any] = [b""]
    side_bytes = 0
    for name, value in arrays.items():
        if not isinstance(name, str):
            raise EncodeError(f"array names must be str, got {type(name).__name__}")
        wire_name = WIRE_NAME.get(value.dtype) if type(value) is np.ndarray else None
        if wire_name is not None and value.ndim == 1 and value.flags.c_contiguous:
            # `export_array`'s result for the common case (every field of a TrajectoryGroup),
            # inlined: a call and a tuple per array are a visible share of a small message.
            specs[name] = ["numpy", wire_name, [len(value)], len(frames)]
            buf = value.view(BYTE)
        else:
            lib, dtype, shape, buf = export_array(name, value)
            specs[name] = [lib, dtype, shape, len(frames)]
        frames.append(buf)
        side_bytes += buf.nbytes  # `export_array` returns 1-D uint8 numpy buffers: no memoryview
    return _seal(frames, kind, specs, fields, side_bytes, max_frames, max_bytes)


def _seal(
    frames: list[Any],
    kind: str,
    specs: dict[str, Any],
    fields: dict[str, Any],
    body_bytes: int,
    max_frames: int,
    max_bytes: int,
) -> list[Any]:
    """Put the header in `frames[0]` (a placeholder until now) and check the limits: the
    frame count, the header's size and the whole message's (`body_bytes`: the other frames)."""
    if len(frames) > max_frames:
        raise EncodeError(f"message has {len(frames)} frames, limit is {max_frames}")
    try:
        frames[0] = _ENCODER.encode([SCHEMA_VERSION, kind, specs, fields])
    except (TypeError, ValueError, OverflowError) as e:
        raise EncodeError(f"cannot encode header: {e}") from None
    check_sizes([len(frames[0]), body_bytes], max_bytes, EncodeError)
    return frames


def message_nbytes(frames: Sequence[Any]) -> int:
    """Total bytes of a message's frames."""
    return sum(memoryview(f).nbytes for f in frames)


def _plain_problem(value: Any, where: str, depth: int, encoding: bool = False) -> str | None:
    """Why `value` is not a plain wire value (None if it is); tuples and numpy scalars are
    accepted when encoding (they arrive as lists and Python numbers)."""
    if type(value) in _SCALARS or isinstance(value, bool | int | float | str | bytes):
        return None
    if encoding and isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return None
    if depth >= _MAX_DEPTH:
        return f"{where}: nested deeper than {_MAX_DEPTH}"
    if isinstance(value, list) or (encoding and isinstance(value, tuple)):
        for i, item in enumerate(value):
            if type(item) in _SCALARS:  # a plain leaf: no call, no path string
                continue
            if problem := _plain_problem(item, f"{where}[{i}]", depth + 1, encoding):
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where}: map key {key!r} is not a str"
            if type(item) in _SCALARS:  # a plain leaf: no call, no path string
                continue
            if problem := _plain_problem(item, f"{where}.{key}", depth + 1, encoding):
                return problem
        return None
    return f"{where}: {type(value).__name__} is not a plain wire value"


# -- decode -------------------------------------------------------------------------------------
def decode_arrays(
    frames: Sequence[Any],
    *,
    kind: str | None = None,
    max_bytes: int = MAX_MESSAGE_BYTES,
    max_frames: int = MAX_FRAMES,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arrays, fields) of a message from `encode_arrays`; `kind`, if given, must match."""
    views = frame_views(frames, max_bytes, max_frames)
    header = _parse_header(views[0], _HEADER_DECODER, kind)
    if problem := _plain_problem(header.fields, "fields", 0):
        raise DecodeError(problem)
    return import_arrays(header.arrays, views), header.fields


def decode_group(
    frames: Sequence[Any], *, max_bytes: int = MAX_MESSAGE_BYTES, max_frames: int = MAX_FRAMES
) -> TrajectoryGroup:
    """The TrajectoryGroup in `frames`, fully validated, or DecodeError."""
    return _decode_group_views(frame_views(frames, max_bytes, max_frames))


def _decode_group_views(views: list[memoryview]) -> TrajectoryGroup:
    """`decode_group` after `frame_views` (its limits checked): also the batch decoder's path for
    a one-group message."""
    header = _parse_header(views[0], _GROUP_DECODER, GROUP_KIND)
    f = header.fields  # group_id, finish_reasons typed-checked by the decoder
    if problem := _plain_problem(f.metadata, "metadata", 1):
        raise DecodeError(problem)
    arrays = import_group_arrays(header.arrays, views)
    try:  # the arrays, finish_reasons and metadata are what `_from_wire` requires (see there)
        return TrajectoryGroup._from_wire(f.group_id, f.finish_reasons, f.metadata, arrays)
    except RecordError as e:
        raise DecodeError(f"invalid trajectory group: {e}") from None


def _parse_header(buf: memoryview, decoder: msgspec.msgpack.Decoder, kind: str | None) -> Any:
    try:
        header = decoder.decode(buf)
    except DecodeError:  # from `_refuse_ext`
        raise
    except (ValueError, RecursionError) as e:  # msgspec.DecodeError, invalid UTF-8, ...
        raise DecodeError(_why_bad_header(buf, kind, e)) from None
    if header.schema != SCHEMA_VERSION:
        raise DecodeError(_version_msg(header.schema))
    if kind is not None and header.kind != kind:
        raise DecodeError(f"expected a {kind!r} message, got {header.kind!r}")
    return header


def _why_bad_header(buf: memoryview, kind: str | None, error: Exception) -> str:
    """For a header that failed typed decoding, name a wrong version or kind first."""
    try:
        obj = _ANY_DECODER.decode(buf)
    except (ValueError, RecursionError):  # DecodeError (an extension type) included
        return f"bad header: {error}"
    if isinstance(obj, list) and len(obj) >= 2:
        if type(obj[0]) is int and obj[0] != SCHEMA_VERSION:
            return _version_msg(obj[0])
        if kind is not None and isinstance(obj[1], str) and obj[1] != kind:
            return f"expected a {kind!r} message, got {obj[1]!r}"
    return f"bad header: {error}"


def _version_msg(version: int) -> str:
    return f"schema version {version}, this decoder reads version {SCHEMA_VERSION}"

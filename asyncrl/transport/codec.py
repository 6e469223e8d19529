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
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import msgspec
import numpy as np

from asyncrl.types import ARRAY_FIELDS, RecordError, TrajectoryGroup

SCHEMA_VERSION = 1
GROUP_KIND = "trajectory_group"
#: Default limits on one message: all frames together, frame count, header frame alone.
MAX_MESSAGE_BYTES = 256 << 20
MAX_FRAMES = 64
MAX_HEADER_BYTES = 1 << 20
_MAX_NDIM = 32
_MAX_DEPTH = 32  # nesting of plain values in `fields`

NUMPY_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}  # fmt: skip
TORCH_DTYPES: frozenset[str] = frozenset(NUMPY_DTYPES) | {
    "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
}  # fmt: skip


class DecodeError(ValueError):
    """A message is not a valid record (malformed, truncated, oversized, wrong version/kind).

    The reason is one printable line of bounded length: it quotes untrusted input (field
    names, group ids) and ends up in logs.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(_one_line(reason))


def _one_line(text: str, limit: int = 400) -> str:
    text = text if len(text) <= limit else text[:limit] + "..."
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class EncodeError(ValueError):
    """A value cannot be put on the wire (unsupported type or dtype, over the size limit)."""


class _ArraySpec(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    lib: str
    dtype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    frame: Annotated[int, msgspec.Meta(ge=1)]


class _Header(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    schema: int
    kind: str
    arrays: dict[str, _ArraySpec]
    fields: dict[str, Any]


class _GroupFields(msgspec.Struct, forbid_unknown_fields=True):
    group_id: str
    finish_reasons: list[str]
    metadata: dict[str, Any]


class _GroupHeader(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A TrajectoryGroup's header: the same layout as `_Header`, with `fields` typed."""

    schema: int
    kind: str
    arrays: dict[str, _ArraySpec]
    fields: _GroupFields


# dtype -> wire name; a dtype lookup, because `np.dtype.name` is slow Python code.
_WIRE_NAME: dict[np.dtype, str] = {dtype: name for name, dtype in NUMPY_DTYPES.items()}
_BYTE = np.dtype(np.uint8)  # a dtype instance: `view(np.uint8)` resolves the type every call
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
    """Frames for one TrajectoryGroup: a header and one frame per array field (8, or 9 with
    advantages)."""
    arrays = {name: getattr(group, name) for name in _GROUP_ARRAYS}
    if arrays["advantages"] is None:
        del arrays["advantages"]
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
        wire_name = _WIRE_NAME.get(value.dtype) if type(value) is np.ndarray else None
        if wire_name is not None and value.ndim == 1 and value.flags.c_contiguous:
            # `_export`'s result for the common case (every field of a TrajectoryGroup),
            # inlined: a call and a tuple per array are a visible share of a small message.
            specs[name] = ["numpy", wire_name, [len(value)], len(frames)]
            buf = value.view(_BYTE)
        else:
            lib, dtype, shape, buf = _export(name, value)
            specs[name] = [lib, dtype, shape, len(frames)]
        frames.append(buf)
        side_bytes += buf.nbytes  # `_export` returns 1-D uint8 numpy buffers: no memoryview
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
    _check_sizes([len(frames[0]), body_bytes], max_bytes, EncodeError)
    return frames


def message_nbytes(frames: Sequence[Any]) -> int:
    """Total bytes of a message's frames."""
    return sum(memoryview(f).nbytes for f in frames)


def _export(name: str, value: Any) -> tuple[str, str, list[int], Any]:
    """(lib, dtype, shape, contiguous little-endian byte buffer) for one array."""
    if type(value) is not np.ndarray:
        torch = sys.modules.get("torch")  # a tensor can only exist if torch is imported
        if torch is not None and isinstance(value, torch.Tensor):
            return _export_torch(name, value, torch)
        if not isinstance(value, np.ndarray | np.generic):
            raise EncodeError(
                f"array {name!r}: expected numpy or torch, got {type(value).__name__}"
            )
        value = np.asarray(value)
    wire_name = _WIRE_NAME.get(value.dtype)
    if wire_name is None:  # not an allowed dtype, or one in big-endian order
        wire_name = _WIRE_NAME.get(value.dtype.newbyteorder("<"))
        if wire_name is None:
            raise EncodeError(f"array {name!r}: dtype {value.dtype} is not supported on the wire")
        value = value.astype(NUMPY_DTYPES[wire_name])
    if not value.flags.c_contiguous:
        value = np.ascontiguousarray(value)
    flat = value if value.ndim == 1 else value.reshape(-1)  # the common 1-D case: no reshape
    return "numpy", wire_name, list(value.shape), flat.view(_BYTE)


def _export_torch(name: str, t: Any, torch: Any) -> tuple[str, str, list[int], Any]:
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in TORCH_DTYPES or t.layout != torch.strided:
        raise EncodeError(f"array {name!r}: torch {t.dtype} ({t.layout}) is not supported")
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        raise EncodeError("torch tensors are only encoded on little-endian hosts")
    try:
        t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    except RuntimeError as e:
        raise EncodeError(f"array {name!r}: cannot bring tensor to host memory: {e}") from None
    return "torch", dtype, list(t.shape), t.reshape(-1).view(torch.uint8).numpy()


def _check_sizes(sizes: list[int], max_bytes: int, error: type) -> None:
    """`sizes[0]` is the header's size; all of them sum to the message's."""
    if sizes[0] > MAX_HEADER_BYTES:
        raise error(f"header is {sizes[0]} bytes, limit is {MAX_HEADER_BYTES}")
    if sum(sizes) > max_bytes:
        raise error(f"message is {sum(sizes)} bytes, limit is {max_bytes}")


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
    views = _views(frames, max_bytes, max_frames)
    header = _parse_header(views[0], _HEADER_DECODER, kind)
    if problem := _plain_problem(header.fields, "fields", 0):
        raise DecodeError(problem)
    return _import_arrays(header.arrays, views), header.fields


def decode_group(
    frames: Sequence[Any], *, max_bytes: int = MAX_MESSAGE_BYTES, max_frames: int = MAX_FRAMES
) -> TrajectoryGroup:
    """The TrajectoryGroup in `frames`, fully validated, or DecodeError."""
    return _decode_group_views(_views(frames, max_bytes, max_frames))


def _decode_group_views(views: list[memoryview]) -> TrajectoryGroup:
    """`decode_group` after `_views` (its limits checked): also the batch decoder's path for
    a one-group message."""
    header = _parse_header(views[0], _GROUP_DECODER, GROUP_KIND)
    f = header.fields  # group_id, finish_reasons typed-checked by the decoder
    if problem := _plain_problem(f.metadata, "metadata", 1):
        raise DecodeError(problem)
    arrays = _import_group_arrays(header.arrays, views)
    try:  # the arrays, finish_reasons and metadata are what `_from_wire` requires (see there)
        return TrajectoryGroup._from_wire(f.group_id, f.finish_reasons, f.metadata, arrays)
    except RecordError as e:
        raise DecodeError(f"invalid trajectory group: {e}") from None


def _views(frames: Sequence[Any], max_bytes: int, max_frames: int) -> list[memoryview]:
    """One flat byte view per frame, after the frame-count and size limits."""
    if not isinstance(frames, list | tuple) or not frames:
        raise DecodeError("a message is a non-empty list of frames")
    if len(frames) > max_frames:
        raise DecodeError(f"message has {len(frames)} frames, limit is {max_frames}")
    try:  # one cast per frame, no per-frame format checks: a cast to "B" is always flat bytes
        views = [memoryview(f).cast("B") for f in frames]
    except (TypeError, ValueError, BufferError):
        views = [_byte_view(f, i) for i, f in enumerate(frames)]  # raises, naming the frame
    _check_sizes([v.nbytes for v in views], max_bytes, DecodeError)
    return views


def _byte_view(frame: Any, index: int) -> memoryview:
    # Also for a non-contiguous buffer (the cast refuses it): msgspec and np.frombuffer need
    # contiguous bytes. ValueError: numpy refuses to export some dtypes (datetime64) at all.
    try:
        return memoryview(frame).cast("B")
    except (TypeError, ValueError, BufferError):
        raise DecodeError(f"frame {index} ({type(frame).__name__}) is not a byte buffer") from None


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


def _frame_for(name: str, spec: _ArraySpec, views: list[memoryview], used: set[int]) -> memoryview:
    if spec.frame >= len(views) or spec.frame in used:
        raise DecodeError(_frame_problem(name, spec.frame))
    used.add(spec.frame)
    return views[spec.frame]


def _frame_problem(name: str, frame: int) -> str:
    return f"array {name!r}: frame {frame} is missing or used twice"


def _import_arrays(specs: Mapping[str, _ArraySpec], views: list[memoryview]) -> dict[str, Any]:
    """Map every side buffer to its array: frames 1.. are used exactly once each."""
    if len(specs) != len(views) - 1:
        raise DecodeError(f"{len(specs)} arrays but {len(views) - 1} side frames")
    used: set[int] = set()
    return {
        name: _import_array(name, s, _frame_for(name, s, views, used)) for name, s in specs.items()
    }


def _import_array(name: str, spec: _ArraySpec, view: memoryview) -> Any:
    if len(spec.shape) > _MAX_NDIM:
        raise DecodeError(f"array {name!r}: {len(spec.shape)} dimensions, limit is {_MAX_NDIM}")
    if max(spec.shape, default=0) > view.nbytes and 0 not in spec.shape:
        raise DecodeError(f"array {name!r}: shape {tuple(spec.shape)} exceeds its frame")
    count = math.prod(spec.shape)
    try:
        if spec.lib == "numpy" and spec.dtype in NUMPY_DTYPES:
            dtype = NUMPY_DTYPES[spec.dtype]
            _check_nbytes(name, spec, count * dtype.itemsize, view)
            return np.frombuffer(view, dtype=dtype).reshape(spec.shape)
        if spec.lib == "torch" and spec.dtype in TORCH_DTYPES:
            return _import_torch(name, spec, count, view)
    except (ValueError, RuntimeError) as e:  # e.g. an empty array whose shape overflows
        if isinstance(e, DecodeError):
            raise
        raise DecodeError(f"array {name!r}: shape {tuple(spec.shape)}: {e}") from None
    raise DecodeError(f"array {name!r}: unsupported array type {spec.lib}/{spec.dtype}")


def _check_nbytes(name: str, spec: _ArraySpec, expected: int, view: memoryview) -> None:
    if view.nbytes != expected:
        raise DecodeError(
            f"array {name!r}: frame {spec.frame} has {view.nbytes} bytes, "
            f"{spec.dtype}{tuple(spec.shape)} needs {expected}"
        )


def _import_torch(name: str, spec: _ArraySpec, count: int, view: memoryview) -> Any:
    try:
        import torch  # deferred: only a torch tensor on the wire needs torch
    except ImportError:
        raise DecodeError(f"array {name!r} is a torch tensor but torch is not installed") from None
    dtype = getattr(torch, spec.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise DecodeError(f"array {name!r}: this torch has no dtype {spec.dtype}")
    _check_nbytes(name, spec, count * dtype.itemsize, view)
    if count == 0:
        return torch.empty(spec.shape, dtype=dtype)
    # torch needs writable memory; a read-only frame (bytes) is copied once.
    raw = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)
    return raw.view(dtype).reshape(spec.shape)


# The one definition of a TrajectoryGroup's arrays on the wire, read by `encode_group` and
# `_import_group_arrays` alike: field -> (little-endian dtype, wire dtype name, itemsize), one
# tuple so the decoder's hot loop does one lookup per array. Only advantages may be absent.
_GROUP_ARRAYS: dict[str, tuple[np.dtype, str, int]] = {
    name: (NUMPY_DTYPES[np.dtype(d).name], np.dtype(d).name, np.dtype(d).itemsize)
    for name, d in ARRAY_FIELDS
}
_GROUP_REQUIRED = frozenset(_GROUP_ARRAYS) - {"advantages"}


def _import_group_arrays(
    specs: Mapping[str, _ArraySpec], views: list[memoryview]
) -> dict[str, np.ndarray]:
    """A TrajectoryGroup's arrays: exactly its fields, each 1-D numpy of its exact dtype,
    frames 1.. used exactly once each; DecodeError naming what is wrong otherwise.

    The only statement of what a valid group layout is, and the hot path of every received
    group: each check is a plain comparison and its text is built only once it has failed, so
    a valid message pays for no message (a separate fast path would only be a second copy)."""
    count = len(views)
    if not _GROUP_REQUIRED <= specs.keys() <= _GROUP_ARRAYS.keys():
        missing = sorted(_GROUP_REQUIRED - specs.keys())
        extra = sorted(specs.keys() - _GROUP_ARRAYS.keys())
        raise DecodeError(f"group arrays: missing {missing}, unexpected {extra}")
    if len(specs) != count - 1:
        raise DecodeError(f"{len(specs)} arrays but {count - 1} side frames")
    out, used = {}, set()
    for name, spec in specs.items():
        dtype, wire_name, itemsize = _GROUP_ARRAYS[name]
        shape, frame = spec.shape, spec.frame
        if spec.lib != "numpy" or spec.dtype != wire_name or len(shape) != 1:
            raise DecodeError(
                f"group array {name!r}: expected 1-D numpy {wire_name}, "
                f"got {len(shape)}-D {spec.lib} {spec.dtype}"
            )
        if frame >= count:  # and frame >= 1: `_ArraySpec` guarantees it
            raise DecodeError(_frame_problem(name, frame))
        view = views[frame]
        if view.nbytes != shape[0] * itemsize:
            if frame in used:  # a reused frame is named as such, not as a size mismatch
                raise DecodeError(_frame_problem(name, frame))
            _check_nbytes(name, spec, shape[0] * itemsize, view)  # raises, with the sizes
        used.add(frame)
        out[name] = np.frombuffer(view, dtype)
    # len(specs) == count - 1 frames, each in 1..count-1: all distinct iff each used once.
    # Checked here, once, rather than per array: this loop is the decoder's hot path.
    if len(used) != len(specs):
        raise DecodeError(_frame_problem(*_first_reused(specs)))
    return out


def _first_reused(specs: Mapping[str, _ArraySpec]) -> tuple[str, int]:
    """The first array whose frame an earlier array already uses (there is one)."""
    seen: set[int] = set()
    for name, spec in specs.items():
        if spec.frame in seen:
            return name, spec.frame
        seen.add(spec.frame)
    raise AssertionError("no frame is used twice")  # pragma: no cover - caller's invariant

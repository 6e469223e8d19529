"""A message's side frames ↔ its arrays: what the wire codec (`codec.py`, one group or any named
arrays) and the batch codec (`batch.py`, several groups in one message) share below their
msgpack headers.

Encoding exports each array as a contiguous little-endian byte buffer that aliases the array's
memory where it can (`export_array`); decoding turns frames into flat byte views after the
size limits (`frame_views`) and each described array into a numpy view of its frame, or a torch
tensor (`import_arrays`; a TrajectoryGroup's arrays through the stricter, faster
`import_group_arrays`). Array dtypes come from a fixed allowlist (no object dtypes); every
problem is one `DecodeError` naming the array and what is wrong. No torch import at load time.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import msgspec
import numpy as np

from asyncrl.types import ARRAY_FIELDS

#: Default limits on one message: all frames together, frame count, header frame alone.
MAX_MESSAGE_BYTES = 256 << 20
MAX_FRAMES = 64
MAX_HEADER_BYTES = 1 << 20
MAX_NDIM = 32

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


class ArraySpec(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One array in a header: `[lib, dtype, shape, frame]` (frame 0 is the header's own)."""

    lib: str
    dtype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    frame: Annotated[int, msgspec.Meta(ge=1)]


# dtype -> wire name; a dtype lookup, because `np.dtype.name` is slow Python code.
WIRE_NAME: dict[np.dtype, str] = {dtype: name for name, dtype in NUMPY_DTYPES.items()}
BYTE = np.dtype(np.uint8)  # a dtype instance: `view(np.uint8)` resolves the type every call


def export_array(name: str, value: Any) -> tuple[str, str, list[int], Any]:
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
    wire_name = WIRE_NAME.get(value.dtype)
    if wire_name is None:  # not an allowed dtype, or one in big-endian order
        wire_name = WIRE_NAME.get(value.dtype.newbyteorder("<"))
        if wire_name is None:
            raise EncodeError(f"array {name!r}: dtype {value.dtype} is not supported on the wire")
        value = value.astype(NUMPY_DTYPES[wire_name])
    if not value.flags.c_contiguous:
        value = np.ascontiguousarray(value)
    flat = value if value.ndim == 1 else value.reshape(-1)  # the common 1-D case: no reshape
    return "numpy", wire_name, list(value.shape), flat.view(BYTE)


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


def check_sizes(sizes: list[int], max_bytes: int, error: type) -> None:
    """`sizes[0]` is the header's size; all of them sum to the message's."""
    if sizes[0] > MAX_HEADER_BYTES:
        raise error(f"header is {sizes[0]} bytes, limit is {MAX_HEADER_BYTES}")
    if sum(sizes) > max_bytes:
        raise error(f"message is {sum(sizes)} bytes, limit is {max_bytes}")


def frame_views(frames: Sequence[Any], max_bytes: int, max_frames: int) -> list[memoryview]:
    """One flat byte view per frame, after the frame-count and size limits."""
    if not isinstance(frames, list | tuple) or not frames:
        raise DecodeError("a message is a non-empty list of frames")
    if len(frames) > max_frames:
        raise DecodeError(f"message has {len(frames)} frames, limit is {max_frames}")
    try:  # one cast per frame, no per-frame format checks: a cast to "B" is always flat bytes
        views = [memoryview(f).cast("B") for f in frames]
    except (TypeError, ValueError, BufferError):
        views = [_byte_view(f, i) for i, f in enumerate(frames)]  # raises, naming the frame
    check_sizes([v.nbytes for v in views], max_bytes, DecodeError)
    return views


def _byte_view(frame: Any, index: int) -> memoryview:
    # Also for a non-contiguous buffer (the cast refuses it): msgspec and np.frombuffer need
    # contiguous bytes. ValueError: numpy refuses to export some dtypes (datetime64) at all.
    try:
        return memoryview(frame).cast("B")
    except (TypeError, ValueError, BufferError):
        raise DecodeError(f"frame {index} ({type(frame).__name__}) is not a byte buffer") from None


def frame_for(name: str, spec: ArraySpec, views: list[memoryview], used: set[int]) -> memoryview:
    if spec.frame >= len(views) or spec.frame in used:
        raise DecodeError(frame_problem(name, spec.frame))
    used.add(spec.frame)
    return views[spec.frame]


def frame_problem(name: str, frame: int) -> str:
    return f"array {name!r}: frame {frame} is missing or used twice"


def import_arrays(specs: Mapping[str, ArraySpec], views: list[memoryview]) -> dict[str, Any]:
    """Map every side buffer to its array: frames 1.. are used exactly once each."""
    if len(specs) != len(views) - 1:
        raise DecodeError(f"{len(specs)} arrays but {len(views) - 1} side frames")
    used: set[int] = set()
    return {
        name: import_array(name, s, frame_for(name, s, views, used)) for name, s in specs.items()
    }


def import_array(name: str, spec: ArraySpec, view: memoryview) -> Any:
    if len(spec.shape) > MAX_NDIM:
        raise DecodeError(f"array {name!r}: {len(spec.shape)} dimensions, limit is {MAX_NDIM}")
    if max(spec.shape, default=0) > view.nbytes and 0 not in spec.shape:
        raise DecodeError(f"array {name!r}: shape {tuple(spec.shape)} exceeds its frame")
    count = math.prod(spec.shape)
    try:
        if spec.lib == "numpy" and spec.dtype in NUMPY_DTYPES:
            dtype = NUMPY_DTYPES[spec.dtype]
            check_nbytes(name, spec, count * dtype.itemsize, view)
            return np.frombuffer(view, dtype=dtype).reshape(spec.shape)
        if spec.lib == "torch" and spec.dtype in TORCH_DTYPES:
            return _import_torch(name, spec, count, view)
    except (ValueError, RuntimeError) as e:  # e.g. an empty array whose shape overflows
        if isinstance(e, DecodeError):
            raise
        raise DecodeError(f"array {name!r}: shape {tuple(spec.shape)}: {e}") from None
    raise DecodeError(f"array {name!r}: unsupported array type {spec.lib}/{spec.dtype}")


def check_nbytes(name: str, spec: ArraySpec, expected: int, view: memoryview) -> None:
    if view.nbytes != expected:
        raise DecodeError(
            f"array {name!r}: frame {spec.frame} has {view.nbytes} bytes, "
            f"{spec.dtype}{tuple(spec.shape)} needs {expected}"
        )


def _import_torch(name: str, spec: ArraySpec, count: int, view: memoryview) -> Any:
    try:
        import torch  # deferred: only a torch tensor on the wire needs torch
    except ImportError:
        raise DecodeError(f"array {name!r} is a torch tensor but torch is not installed") from None
    dtype = getattr(torch, spec.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise DecodeError(f"array {name!r}: this torch has no dtype {spec.dtype}")
    check_nbytes(name, spec, count * dtype.itemsize, view)
    if count == 0:
        return torch.empty(spec.shape, dtype=dtype)
    # torch needs writable memory; a read-only frame (bytes) is copied once.
    raw = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)
    return raw.view(dtype).reshape(spec.shape)


# The one definition of a TrajectoryGroup's arrays on the wire, read by `encode_group` and
# `import_group_arrays` alike: field -> (little-endian dtype, wire dtype name, itemsize), one
# tuple so the decoder's hot loop does one lookup per array. Only advantages may be absent.
GROUP_ARRAYS: dict[str, tuple[np.dtype, str, int]] = {
    name: (NUMPY_DTYPES[np.dtype(d).name], np.dtype(d).name, np.dtype(d).itemsize)
    for name, d in ARRAY_FIELDS
}
GROUP_REQUIRED = frozenset(GROUP_ARRAYS) - {"advantages"}
#: The one 2-D group array (optional): `TrajectoryGroup.routes`, uint8 [positions, width].
ROUTES = "routes"
GROUP_OPTIONAL_2D = frozenset({ROUTES})


def import_group_arrays(
    specs: Mapping[str, ArraySpec], views: list[memoryview]
) -> dict[str, np.ndarray]:
    """A TrajectoryGroup's arrays: exactly its fields, each 1-D numpy of its exact dtype,
    frames 1.. used exactly once each; DecodeError naming what is wrong otherwise.

    The only statement of what a valid group layout is, and the hot path of every received
    group: each check is a plain comparison and its text is built only once it has failed, so
    a valid message pays for no message (a separate fast path would only be a second copy)."""
    count = len(views)
    if not GROUP_REQUIRED <= specs.keys() <= GROUP_ARRAYS.keys() | GROUP_OPTIONAL_2D:
        missing = sorted(GROUP_REQUIRED - specs.keys())
        extra = sorted(specs.keys() - GROUP_ARRAYS.keys() - GROUP_OPTIONAL_2D)
        raise DecodeError(f"group arrays: missing {missing}, unexpected {extra}")
    if len(specs) != count - 1:
        raise DecodeError(f"{len(specs)} arrays but {count - 1} side frames")
    out, used = {}, set()
    for name, spec in specs.items():
        if name == ROUTES:
            out[name] = _import_routes(spec, views, count, used)
            continue
        dtype, wire_name, itemsize = GROUP_ARRAYS[name]
        shape, frame = spec.shape, spec.frame
        if spec.lib != "numpy" or spec.dtype != wire_name or len(shape) != 1:
            raise DecodeError(
                f"group array {name!r}: expected 1-D numpy {wire_name}, "
                f"got {len(shape)}-D {spec.lib} {spec.dtype}"
            )
        if frame >= count:  # and frame >= 1: `ArraySpec` guarantees it
            raise DecodeError(frame_problem(name, frame))
        view = views[frame]
        if view.nbytes != shape[0] * itemsize:
            if frame in used:  # a reused frame is named as such, not as a size mismatch
                raise DecodeError(frame_problem(name, frame))
            check_nbytes(name, spec, shape[0] * itemsize, view)  # raises, with the sizes
        used.add(frame)
        out[name] = np.frombuffer(view, dtype)
    # len(specs) == count - 1 frames, each in 1..count-1: all distinct iff each used once.
    # Checked here, once, rather than per array: this loop is the decoder's hot path.
    if len(used) != len(specs):
        raise DecodeError(frame_problem(*_first_reused(specs)))
    return out


def _import_routes(
    spec: ArraySpec, views: list[memoryview], count: int, used: set[int]
) -> np.ndarray:
    """The group's `routes`: 2-D numpy uint8 [positions, width >= 1], its own frame."""
    shape, frame = spec.shape, spec.frame
    if spec.lib != "numpy" or spec.dtype != "uint8" or len(shape) != 2 or shape[1] < 1:
        raise DecodeError(
            f"group array 'routes': expected 2-D numpy uint8 [positions, layers * top_k], "
            f"got {len(shape)}-D {spec.lib} {spec.dtype} {tuple(shape)}"
        )
    if frame >= count or frame in used:
        raise DecodeError(frame_problem(ROUTES, frame))
    view = views[frame]
    check_nbytes(ROUTES, spec, shape[0] * shape[1], view)
    used.add(frame)
    return np.frombuffer(view, np.uint8).reshape(shape)


def _first_reused(specs: Mapping[str, ArraySpec]) -> tuple[str, int]:
    """The first array whose frame an earlier array already uses (there is one)."""
    seen: set[int] = set()
    for name, spec in specs.items():
        if spec.frame in seen:
            return name, spec.frame
        seen.add(spec.frame)
    raise AssertionError("no frame is used twice")  # pragma: no cover - caller's invariant

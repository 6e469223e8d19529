"""Weight buckets: grouping named tensors and the flattened-bucket byte layout.

Shared by the learner (sender) and the hf engine server (receiver), so both sides compute the
same layout from the same metadata. The flattened layout is SGLang's `load_format =
"flattened_bucket"`: one uint8 buffer per bucket, tensors flattened and concatenated in the
given name order, each tensor's byte offset rounded up to a multiple of its dtype's itemsize
(so every slice can be viewed as that dtype without a copy). The sender's per-bucket choice of
that layout or a broadcast per tensor (`load_format="auto"`) is `bucket_format`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

# Wire names (SGLang writes dtypes without the "torch." prefix). A fixed table, never getattr on
# a string from the wire.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}


class BucketLayoutError(ValueError):
    """Bucket metadata that cannot be laid out (unknown dtype, bad shape, size mismatch)."""


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"` (the wire spelling)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise BucketLayoutError(f"dtype {dtype} cannot be sent as a weight") from None


def parse_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` or `"torch.bfloat16"` -> `torch.bfloat16`; unknown names raise."""
    if not isinstance(name, str):
        raise BucketLayoutError(f"dtype must be a string, got {type(name).__name__}")
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise BucketLayoutError(f"unknown dtype {name!r} (known: {', '.join(DTYPES)})")
    return DTYPES[key]


def parse_shape(shape: object) -> tuple[int, ...]:
    if not isinstance(shape, list | tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise BucketLayoutError(f"shape must be a list of non-negative ints, got {shape!r}")
    return tuple(shape)


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucketize(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    split_dtypes: bool = False,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group `(name, tensor)` pairs into buckets of at most `bucket_bytes` bytes, in order.

    Lazy: a bucket is yielded as soon as it is full, so the caller never holds more than one
    bucket of (possibly converted) tensors. A tensor larger than `bucket_bytes` gets a bucket of
    its own. Empty input yields nothing. `split_dtypes` also starts a new bucket whenever the
    dtype changes: SGLang's flattened receiver concatenates the raw bytes without padding and
    views each slice as its dtype, so one dtype per bucket is the layout both sides share (the
    aligned offsets of `flat_layout` then never add padding).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_nbytes(tensor)
        new_dtype = split_dtypes and bucket and bucket[-1][1].dtype != tensor.dtype
        if bucket and (size + nbytes > bucket_bytes or new_dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def flat_layout(
    dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> tuple[list[int], int]:
    """Byte offset of every tensor in a flattened bucket, and the bucket's total size."""
    offsets: list[int] = []
    offset = 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        itemsize = dtype.itemsize
        offset = -(-offset // itemsize) * itemsize  # round up: aligned views, no copies
        offsets.append(offset)
        numel = 1
        for d in shape:
            numel *= d
        offset += numel * itemsize
    return offsets, offset


def flatten_bucket(
    tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Pack tensors into one uint8 buffer laid out by `flat_layout` (on the tensors' device).

    With `out` (a uint8 buffer on that device, at least the bucket's size) the bytes go into
    `out[:total]` and that view is returned: a reused buffer skips allocating and first-touching
    a bucket's worth of fresh memory on every sync. Alignment gaps are zeroed.
    """
    if not tensors:
        raise BucketLayoutError("cannot flatten an empty bucket")
    offsets, total = flat_layout([t.dtype for t in tensors], [t.shape for t in tensors])
    device = tensors[0].device
    if out is None:
        buf = torch.empty(total, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.device != device or out.numel() < total:
        raise BucketLayoutError(f"staging buffer cannot hold a {total}-byte bucket on {device}")
    else:
        buf = out[:total]
    end = 0
    for t, off in zip(tensors, offsets):
        if off > end:
            buf[end:off].zero_()
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buf[off : off + raw.numel()].copy_(raw)
        end = off + raw.numel()
    return buf


class StagingBuffer:
    """One reusable uint8 buffer, grown on demand (never shrunk until `release`).

    Host memory only pays off when kept: a fresh bucket-sized allocation is page-faulted in on
    every sync, which on a CPU costs about as much as the broadcast itself. On accelerators the
    caching allocator already recycles blocks, so `finish` frees it after each sync there.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 view of exactly `nbytes` bytes on `device` (contents undefined)."""
        buf = self._buf
        if buf is None or buf.device != device or buf.numel() < nbytes:
            self._buf = None  # drop the old one before allocating its successor
            buf = self._buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def release(self) -> None:
        self._buf = None

    def finish(self) -> None:
        """End of a sync: host memory is kept for the next one, accelerator memory is freed."""
        if self._buf is not None and self._buf.device.type != "cpu":
            self._buf = None


def unflatten_bucket(
    buf: torch.Tensor, dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Views into `buf` (a uint8 buffer from `flatten_bucket`), one per tensor, no copies."""
    offsets, total = flat_layout(dtypes, shapes)
    if buf.dtype != torch.uint8 or buf.numel() != total:
        raise BucketLayoutError(f"bucket buffer has {buf.numel()} bytes, layout needs {total}")
    out = []
    for dtype, shape, off in zip(dtypes, shapes, offsets):
        itemsize = dtype.itemsize
        numel = 1
        for d in shape:
            numel *= d
        out.append(buf[off : off + numel * itemsize].view(dtype).view(tuple(shape)))
    return out


# Adapter-only syncs (LoRA): per linear layer `M` (weight `M.weight` [out, in]) the learner sends
# `M.lora_A.weight` [r, in] and `M.lora_B.weight` [out, r], the LoRA scaling folded into B, so
# the engine serves W0 + B·A without knowing the adapter's config.
LORA_A, LORA_B = "lora_A.weight", "lora_B.weight"


def lora_half(name: str) -> tuple[str, str] | None:
    """(LORA_A or LORA_B, the layer's weight name) for an adapter tensor's name, else None."""
    for half in (LORA_A, LORA_B):
        if name.endswith("." + half):
            return half, name.removesuffix(half) + "weight"
    return None


def with_last(it: Iterable) -> Iterator[tuple[object, bool]]:
    """Each item of `it` with whether it is the last one (the sender's version rides on the
    last bucket only)."""
    it = iter(it)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


#: `load_format="auto"`: buckets whose tensors average at least this many bytes go per tensor.
PER_TENSOR_MIN_BYTES = 1 << 20


def bucket_format(bucket: list[tuple[str, torch.Tensor]]) -> str | None:
    """Per tensor (received straight into the parameters, no copies) when the tensors are large;
    one flattened broadcast when they are small, where each collective's latency dominates."""
    mean = sum(tensor_nbytes(t) for _, t in bucket) / len(bucket)
    return None if mean >= PER_TENSOR_MIN_BYTES else "flattened_bucket"

"""Several TrajectoryGroups in one message: the sender's backlog leaves as one batch.

A batch message has the codec's layout (`codec.py`) with kind `"trajectory_batch"`: frame 0 is
the header `[schema, kind, arrays, fields]`; `arrays` names the same fields as a single group's
message (8, or 9 with advantages, each 1-D numpy of the field's dtype, one frame each), holding
the K groups' arrays concatenated in order; `fields` is a map of five lists, one entry per
group: `group_ids` (str), `finish_reasons` (list of str), `metadata` (str-keyed map of plain
values), `prompt_lengths` and `sizes` (responses in the group), non-negative ints.

Why: on 1k-token groups a message's fixed costs (frames, header, numpy calls) dominate, so
moving K groups costs little more than moving one. Validation runs once over the concatenated
arrays: every value check of a TrajectoryGroup is element-wise, so the batch passes iff every
group would pass alone; when it fails, the groups are checked one by one to name the first
bad one, with the message a single group's decode gives. A batch is refused whole (one
DecodeError): only a hostile or corrupt sender can produce a bad group, since a real one
validated every group when it built it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Annotated, Any

import msgspec
import numpy as np

from asyncrl.transport.codec import (
    GROUP_KIND,
    SCHEMA_VERSION,
    _decode_group_views,
    _parse_header,
    _plain_problem,
    _refuse_ext,
    _seal,
    encode_group,
)
from asyncrl.transport.frames import (
    GROUP_ARRAYS,
    MAX_FRAMES,
    MAX_MESSAGE_BYTES,
    ROUTES,
    ArraySpec,
    DecodeError,
    EncodeError,
    frame_views,
    import_group_arrays,
)
from asyncrl.types import RecordError, TrajectoryGroup

BATCH_KIND = "trajectory_batch"
#: Groups in one batch message at most: bounds the per-group work one message can ask of the
#: receiver (a 1 MB header could otherwise list ~10^5 empty groups).
MAX_BATCH_GROUPS = 1024
#: A backlog is batched up to this many array bytes per message. Batching pays for small groups,
#: whose per-message costs (frames, header, numpy and Python calls) dominate; a group this large
#: or larger already amortises them and goes alone, zero-copy (a batch concatenates: one copy).
BATCH_BYTES = 256 << 10
# A count cannot exceed a message's bytes; the bound keeps int64 sums of K counts exact.
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]


class _BatchFields(msgspec.Struct, forbid_unknown_fields=True):
    group_ids: list[str]
    finish_reasons: list[list[str]]
    metadata: list[dict[str, Any]]
    prompt_lengths: list[_Count]
    sizes: list[_Count]


class _BatchHeader(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    schema: int
    kind: str
    arrays: dict[str, ArraySpec]
    fields: _BatchFields


class _KindHeader(msgspec.Struct, array_like=True):
    """Only what picks the decoder: schema and kind (the rest is left undecoded)."""

    schema: int
    kind: str


_BATCH_DECODER = msgspec.msgpack.Decoder(_BatchHeader, ext_hook=_refuse_ext)
_KIND_DECODER = msgspec.msgpack.Decoder(_KindHeader, ext_hook=_refuse_ext)


# -- encode -------------------------------------------------------------------------------------
def encode_batch(
    groups: Sequence[TrajectoryGroup],
    *,
    max_bytes: int = MAX_MESSAGE_BYTES,
    max_frames: int = MAX_FRAMES,
) -> list[Any]:
    """Frames for K >= 1 groups in one message; all of them carry advantages or none do."""
    if not 1 <= len(groups) <= MAX_BATCH_GROUPS:
        raise EncodeError(f"a batch holds 1 to {MAX_BATCH_GROUPS} groups, not {len(groups)}")
    with_adv = {g.advantages is not None for g in groups}
    if len(with_adv) != 1:
        raise EncodeError("a batch's groups must all carry advantages or none")
    names = [n for n in GROUP_ARRAYS if n != "advantages" or with_adv == {True}]
    route_widths = {None if g.routes is None else g.routes.shape[1] for g in groups}
    if len(route_widths) != 1:
        raise EncodeError("a batch's groups must all carry routes of one width or none")
    if route_widths != {None}:
        names.append(ROUTES)
    for g in groups:  # what the record's own validation does not already guarantee
        if not isinstance(g.group_id, str) or not all(type(r) is str for r in g.finish_reasons):
            raise EncodeError("group_id and finish_reasons must be str")
        if problem := _plain_problem(g.metadata, "metadata", 1, encoding=True):
            raise EncodeError(problem)
    frames: list[Any] = [b""]
    specs: dict[str, list[Any]] = {}
    for name in names:
        flat = np.concatenate([getattr(g, name) for g in groups])
        wire = "uint8" if name == ROUTES else GROUP_ARRAYS[name][1]
        specs[name] = ["numpy", wire, list(flat.shape), len(frames)]
        frames.append(flat.reshape(-1).view(np.uint8))
    fields = {
        "group_ids": [g.group_id for g in groups],
        "finish_reasons": [g.finish_reasons for g in groups],
        "metadata": [g.metadata for g in groups],
        "prompt_lengths": [len(g.prompt_ids) for g in groups],
        "sizes": [len(g.response_lengths) for g in groups],
    }
    body = sum(f.nbytes for f in frames[1:])
    return _seal(frames, BATCH_KIND, specs, fields, body, max_frames, max_bytes)


def encode_groups(
    groups: Sequence[TrajectoryGroup], *, max_bytes: int = MAX_MESSAGE_BYTES
) -> list[Any]:
    """One group's message for one group (the stored and single-send layout), else a batch."""
    if len(groups) == 1:
        return encode_group(groups[0], max_bytes=max_bytes)
    return encode_batch(groups, max_bytes=max_bytes)


def chunk_groups(groups: Sequence[TrajectoryGroup], budget: int) -> list[list[TrajectoryGroup]]:
    """Consecutive runs of `groups` of at most `budget` array bytes and `MAX_BATCH_GROUPS`
    groups each (a group larger than `budget` goes alone), split where advantages start or stop
    (a batch has them all or none)."""
    out: list[list[TrajectoryGroup]] = []
    size = 0
    for g in groups:
        nbytes = _array_bytes(g)
        if (
            not out
            or size + nbytes > budget
            or len(out[-1]) == MAX_BATCH_GROUPS
            or (g.advantages is None) != (out[-1][0].advantages is None)
            or _route_width(g) != _route_width(out[-1][0])
        ):
            out.append([])
            size = 0
        out[-1].append(g)
        size += nbytes
    return out


def _route_width(g: TrajectoryGroup) -> int | None:
    return None if g.routes is None else g.routes.shape[1]


def _array_bytes(g: TrajectoryGroup) -> int:
    """`g.nbytes`, from the field dtypes a TrajectoryGroup guarantees (4-byte prompt ids,
    lengths, rewards; 13 bytes a token, 17 with advantages): 6x cheaper than summing."""
    per_token = 13 if g.advantages is None else 17
    routes = 0 if g.routes is None else g.routes.nbytes
    return (
        4 * len(g.prompt_ids) + 8 * len(g.response_lengths) + per_token * len(g.response_ids)
    ) + routes


# -- decode -------------------------------------------------------------------------------------
def decode_groups(
    frames: Sequence[Any], *, max_bytes: int = MAX_MESSAGE_BYTES, max_frames: int = MAX_FRAMES
) -> list[TrajectoryGroup]:
    """The groups of a `trajectory_group` or `trajectory_batch` message, every one validated
    as `decode_group` validates one, or one DecodeError for the whole message."""
    views = frame_views(frames, max_bytes, max_frames)
    try:
        head = _KIND_DECODER.decode(views[0])
    except (ValueError, RecursionError):  # the full decoders name the problem exactly
        head = None
    if head is None or head.kind != BATCH_KIND or head.schema != SCHEMA_VERSION:
        # a single group, or anything else: refused by `decode_group` with its own reason
        return [_decode_group_views(views)]
    header = _parse_header(views[0], _BATCH_DECODER, BATCH_KIND)
    f = header.fields
    count = len(f.group_ids)
    lists = (f.finish_reasons, f.metadata, f.prompt_lengths, f.sizes)
    if not 1 <= count <= MAX_BATCH_GROUPS or any(len(x) != count for x in lists):
        raise DecodeError(f"batch: {count} group ids but lists of {[len(x) for x in lists]}")
    for meta in f.metadata:
        if problem := _plain_problem(meta, "metadata", 1):
            raise DecodeError(problem)
    arrays = import_group_arrays(header.arrays, views)
    bounds = _bounds(f, arrays)
    _check_values(f, arrays, bounds)
    return _split(f, arrays, bounds)


def _bounds(f: _BatchFields, arrays: dict[str, np.ndarray]) -> dict[str, list[int]]:
    """Start offsets (K + 1 each, Python ints) of every group on the prompt, response and
    token axes, after the lengths are checked to tile each concatenated array exactly."""
    prompt, resp = (
        list(accumulate(f.prompt_lengths, initial=0)),
        list(accumulate(f.sizes, initial=0)),
    )
    if len(arrays["prompt_ids"]) != prompt[-1]:
        raise DecodeError(
            f"batch: prompt_ids has {len(arrays['prompt_ids'])} ids, not {prompt[-1]}"
        )
    for name in ("response_lengths", "rewards"):
        if len(arrays[name]) != resp[-1]:
            raise DecodeError(f"batch: {name} has {len(arrays[name])} entries, not {resp[-1]}")
    for gid, reasons, n in zip(f.group_ids, f.finish_reasons, f.sizes, strict=True):
        if not gid or len(reasons) != n:
            raise DecodeError(f"invalid trajectory group: group {gid!r}: empty id or {n} "
                              f"responses but {len(reasons)} finish_reasons")  # fmt: skip
    lengths = arrays["response_lengths"]
    if lengths.size and int(np.minimum.reduce(lengths)) < 0:
        _first_bad(f, arrays, {"prompt": prompt, "resp": resp, "token": []})
    ends = [0, *np.cumsum(lengths, dtype=np.int64).tolist()]  # int64: int32 lengths cannot wrap
    token = [ends[r] for r in resp]
    bounds = {"prompt": prompt, "resp": resp, "token": token}
    if ROUTES in arrays:  # each group's n x prompt + response positions
        pos = [n * p + t for n, p, t in zip(f.sizes, f.prompt_lengths, _diffs(token))]
        bounds[ROUTES] = list(accumulate(pos, initial=0))
        if len(arrays[ROUTES]) != bounds[ROUTES][-1]:
            raise DecodeError(
                f"batch: routes has {len(arrays[ROUTES])} positions, not {bounds[ROUTES][-1]}"
            )
    for name in arrays.keys() - _NOT_TOKEN_AXIS:
        if len(arrays[name]) != token[-1]:
            raise DecodeError(f"batch: {name} has {len(arrays[name])} tokens, not {token[-1]}")
    return bounds


def _diffs(starts: list[int]) -> list[int]:
    return [b - a for a, b in zip(starts, starts[1:])]


# The axis each array field is cut along: a group's prompt, its responses, its tokens, or
# (routes) its positions.
_AXIS = {"prompt_ids": "prompt", "response_lengths": "resp", "rewards": "resp", ROUTES: ROUTES}
_NOT_TOKEN_AXIS = frozenset(_AXIS)


def _check_values(f: _BatchFields, arrays: dict[str, np.ndarray], bounds: dict) -> None:
    """`TrajectoryGroup._check_values` once over the concatenation (element-wise checks: it
    passes iff each group passes); on failure, name the first bad group."""
    whole = TrajectoryGroup.__new__(TrajectoryGroup)
    whole.__dict__.update(arrays, group_id="batch", advantages=arrays.get("advantages"))
    try:
        whole._check_values()
    except RecordError:
        _first_bad(f, arrays, bounds)


def _split(f: _BatchFields, arrays: dict[str, np.ndarray], bounds: dict) -> list[TrajectoryGroup]:
    """The K groups as views into the message's frames (no copy), built without a check of
    their own: `_bounds` and `_check_values` established, for the whole batch, everything
    `TrajectoryGroup._check` establishes for one (as `TrajectoryGroup._from_wire` relies on
    the codec). Callers that need a group checked call its `_check`."""
    cuts = [(name, a, bounds[_AXIS.get(name, "token")]) for name, a in arrays.items()]
    advantages = "advantages" in arrays
    out = []
    new = TrajectoryGroup.__new__
    for i, (gid, reasons, meta) in enumerate(zip(f.group_ids, f.finish_reasons, f.metadata)):
        group = new(TrajectoryGroup)
        d = {name: a[axis[i] : axis[i + 1]] for name, a, axis in cuts}
        if not advantages:
            d["advantages"] = None
        d.setdefault(ROUTES, None)
        d["group_id"], d["finish_reasons"], d["metadata"] = gid, reasons, meta
        group.__dict__.update(d)
        out.append(group)
    return out


def _first_bad(f: _BatchFields, arrays: dict[str, np.ndarray], bounds: dict) -> None:
    """Raise DecodeError for the first group of the batch that fails its own check."""
    if not bounds["token"]:  # a negative response length: the token axis has no bounds yet
        resp = bounds["resp"]
        for i, gid in enumerate(f.group_ids):
            part = arrays["response_lengths"][resp[i] : resp[i + 1]]
            if part.size and int(np.minimum.reduce(part)) < 0:
                raise DecodeError(
                    f"invalid trajectory group: group {gid}: negative response length"
                )
    for group in _split(f, arrays, bounds):
        try:
            group._check()
        except RecordError as e:
            raise DecodeError(f"invalid trajectory group: {e}") from None
    raise AssertionError("batch failed a check that none of its groups fails")  # pragma: no cover


__all__ = [
    "BATCH_KIND",
    "GROUP_KIND",
    "chunk_groups",
    "decode_groups",
    "encode_batch",
    "encode_groups",
]

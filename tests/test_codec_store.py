"""Groups at rest (`group_to_bytes` / `group_from_bytes`): the wire's frames, length-prefixed.

The container is rebuilt here from its documented layout (`_pack`), so these tests pin the
format itself, not only the round trip.
"""

from __future__ import annotations

import dataclasses
import struct

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.transport.codec import (
    DecodeError,
    EncodeError,
    decode_group,
    encode_arrays,
    encode_group,
)
from asyncrl.transport.stored import group_from_bytes, group_to_bytes
from asyncrl.types import TrajectoryGroup
from tests.test_codec import make_group

MAGIC = b"ARLGRP\x00\x01"


def _pack(frames: list) -> bytes:
    """The documented layout: magic, u64 frame count, u64 lengths, frames zero-padded to 8."""
    raw = [bytes(memoryview(f)) for f in frames]
    out = MAGIC + struct.pack(f"<{1 + len(raw)}Q", len(raw), *map(len, raw))
    return out + b"".join(r + bytes(-len(r) % 8) for r in raw)


def _group(n: int = 3, seed: int = 0, advantages: bool = False, **kw: object) -> TrajectoryGroup:
    """test_codec's group without its metadata, unless `kw` gives fields."""
    return dataclasses.replace(make_group(n, seed, advantages), **{"metadata": {}, **kw})


def _empty_responses() -> TrajectoryGroup:
    response = {"response_ids": [], "rollout_logprobs": [], "versions": [], "advantages": []}
    return TrajectoryGroup.from_responses(
        "z", [], [{**response, "reward": 0.0, "finish_reason": "abort"}] * 2
    )


GROUPS = {
    "plain": _group(),
    "advantages": _group(seed=1, advantages=True),
    "metadata": _group(
        seed=2, metadata={"task": "t", "nested": {"k": [1, 2.5, None, True, b"\x00raw"]}}
    ),
    "many": _group(n=40, seed=3, advantages=True),
    "no_responses": TrajectoryGroup.from_responses("empty", [], []),
    "empty_responses": _empty_responses(),
}


# -- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", GROUPS)
def test_round_trip_stores_exactly_the_wire_frames(name: str) -> None:
    g = GROUPS[name]
    data = group_to_bytes(g)
    assert data == _pack(encode_group(g))  # the wire's frames, nothing added or changed
    got = group_from_bytes(data)
    assert got == g
    assert group_to_bytes(got) == data  # deterministic: stored again, the same bytes
    assert group_from_bytes(bytearray(data)) == g
    assert group_from_bytes(memoryview(data)) == g


def test_decoded_arrays_are_aligned_read_only_views() -> None:
    data = group_to_bytes(GROUPS["advantages"])
    got = group_from_bytes(data)
    for name in ("prompt_ids", "response_ids", "rollout_logprobs", "versions", "advantages"):
        array = getattr(got, name)
        assert array.flags.aligned and not array.flags.writeable
        assert np.shares_memory(array, np.frombuffer(data, np.uint8))  # a view, not a copy


def test_limits_apply_as_on_the_wire() -> None:
    g = GROUPS["plain"]
    with pytest.raises(EncodeError, match="limit is 100"):
        group_to_bytes(g, max_bytes=100)
    data = group_to_bytes(g)
    with pytest.raises(DecodeError, match="limit is 64"):
        group_from_bytes(data, max_bytes=64)
    with pytest.raises(DecodeError, match="stored group has 8 frames, limit is 4"):
        group_from_bytes(data, max_frames=4)


# -- refusals -----------------------------------------------------------------------------------
def _refused(data: object, match: str | None = None) -> str:
    with pytest.raises(DecodeError, match=match) as info:
        group_from_bytes(data)
    reason = str(info.value)
    assert "\n" not in reason and len(reason) < 500
    return reason


def test_every_truncation_is_refused() -> None:
    data = group_to_bytes(GROUPS["metadata"])
    for size in range(len(data)):
        _refused(data[:size])
    _refused(data[:20], "truncated: 20 bytes, its table needs 80")
    _refused(data[:-1], "truncated: frame 7 needs")


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (None, "a stored group is bytes, got NoneType"),
        ("text", "a stored group is bytes, got str"),
        (b"", "not a stored trajectory group"),
        (b"\x00" * 64, "not a stored trajectory group"),
        (b"PK\x03\x04" + bytes(200), "not a stored trajectory group .*PK"),
        (MAGIC + struct.pack("<Q", 2**63), "has 9223372036854775808 frames, limit is 64"),
        (MAGIC + struct.pack("<QQ", 1, 2**62), "truncated: frame 0 needs"),
        (MAGIC + struct.pack("<Q", 0), "non-empty list of frames"),
    ],
)
def test_garbage_is_refused_with_one_line(data: object, match: str) -> None:
    _refused(data, match)


def test_container_damage_is_refused() -> None:
    data = group_to_bytes(GROUPS["plain"])
    _refused(data + b"\x00" * 8, "8 bytes after its last frame")
    frames = encode_group(GROUPS["plain"])
    length = len(frames[0])  # the header frame: its padding follows it
    assert length % 8, "pick a group whose header needs padding"
    offset = 16 + 8 * len(frames) + length
    _refused(data[:offset] + b"\x01" + data[offset + 1 :], "padding after frame 0 is not zero")


def test_frames_inside_are_checked_like_the_wire() -> None:
    frames = encode_group(GROUPS["plain"])
    header = msgspec.msgpack.decode(bytes(frames[0]))
    header[0] = 2
    _refused(_pack([msgpack.packb(header), *frames[1:]]), "schema version 2, this decoder")
    _refused(_pack(frames[:-1]), "side frames|missing or used twice")
    _refused(_pack(encode_arrays({"a": np.zeros(3)})), "expected a 'trajectory_group' message")
    _refused(_pack([b"\xc1", *frames[1:]]), "bad header")
    bad_mask = np.full(GROUPS["plain"].num_tokens, 7, np.uint8)
    _refused(_pack([*frames[:5], bad_mask, *frames[6:]]), "invalid trajectory group: .*loss_mask")


STORED = [group_to_bytes(g) for g in GROUPS.values()]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.sampled_from(STORED), st.data())
def test_damaged_blobs_only_raise_decode_error(data: bytes, draw: st.DataObject) -> None:
    buf = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 4))):
        i = draw.draw(st.integers(0, len(buf) - 1))
        buf[i] = draw.draw(st.integers(0, 255))
    try:
        got = group_from_bytes(bytes(buf))
    except DecodeError:
        return
    assert group_from_bytes(group_to_bytes(got)) == got  # what decodes is a complete record
    assert decode_group(encode_group(got)) == got

"""Fuzz the decoder: random bytes and mutated valid messages only ever raise DecodeError.

A mutated message may still decode (a flipped bit inside a logprob is a valid logprob); then the
result must be a complete, valid record that survives another round trip. The default run uses a
few hundred examples per property; `pytest -m slow` runs 100k mutated messages and 35k
random ones.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.transport.codec import (
    DecodeError,
    decode_arrays,
    decode_group,
    encode_arrays,
    encode_group,
)
from asyncrl.types import NOT_GENERATED, TrajectoryGroup

QUICK = settings(max_examples=300, deadline=None, derandomize=True)
SLOW = settings(
    max_examples=35_000, deadline=None, suppress_health_check=list(HealthCheck), database=None
)


def _group(seed: int) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 4))
    lengths = rng.integers(0, 5, n)
    total = int(lengths.sum())
    mask = rng.integers(0, 2, total)
    return TrajectoryGroup(
        group_id=f"g{seed}",
        prompt_ids=rng.integers(0, 100, 3),
        response_lengths=lengths,
        response_ids=rng.integers(0, 100, total),
        rollout_logprobs=-rng.random(total),
        loss_mask=mask,
        versions=np.where(mask == 1, seed % 5, NOT_GENERATED),
        rewards=rng.random(n),
        finish_reasons=["stop"] * n,
        advantages=rng.random(total) if seed % 2 else None,
        metadata={"seed": seed, "tags": ["a", "b"], "blob": b"\x01"},
    )


VALID = [[bytes(memoryview(f)) for f in encode_group(_group(s))] for s in range(6)]
VALID_ARRAYS = [
    bytes(memoryview(f))
    for f in encode_arrays(
        {"w": np.arange(6, dtype=np.float16).reshape(2, 3), "s": np.int64(4)}, {"k": [1]}
    )
]

plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=10,
)  # fmt: skip


def _decode_only_decode_error(frames: list[Any]) -> None:
    """decode_group either returns a valid, re-encodable group or raises DecodeError."""
    try:
        group = decode_group(frames)
    except DecodeError as e:
        assert str(e) and "\n" not in str(e) and len(str(e)) <= 500
        return
    assert isinstance(group, TrajectoryGroup)
    # Re-encodes to the same bytes (compared as bytes: metadata may hold a NaN, NaN != NaN).
    again = encode_group(decode_group(encode_group(group)))
    assert [bytes(memoryview(f)) for f in again] == [
        bytes(memoryview(f)) for f in encode_group(group)
    ]


def _paths(obj: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) slot in a decoded header, the root's items included."""
    out: list[tuple[Any, Any]] = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for key, value in list(items):
        out.append((obj, key))
        if isinstance(value, list | dict):
            out.extend(_paths(value))
    return out


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    """A valid message with one to three mutations of the frames or of a header field."""
    frames = list(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "truncate", "drop", "dup", "swap", "insert", "field"]))
        i = draw(st.integers(0, len(frames) - 1)) if frames else 0
        if op == "flip" and frames and frames[i]:
            buf = bytearray(frames[i])
            pos = draw(st.integers(0, len(buf) - 1))
            buf[pos] ^= 1 << draw(st.integers(0, 7))
            frames[i] = bytes(buf)
        elif op == "truncate" and frames:
            frames[i] = frames[i][: draw(st.integers(0, max(0, len(frames[i]) - 1)))]
        elif op == "drop" and frames:
            frames.pop(i)
        elif op == "dup" and frames:
            frames.insert(i, frames[i])
        elif op == "swap" and len(frames) > 1:
            j = draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
        elif op == "insert":
            frames.insert(i, draw(st.binary(max_size=64)))
        elif op == "field" and frames:
            frames[0] = _mutate_header(draw, frames[0])
    return frames


def _mutate_header(draw: st.DrawFn, raw: bytes) -> bytes:
    try:
        header = msgspec.msgpack.decode(raw)
    except (ValueError, RecursionError):  # already broken by an earlier mutation
        return raw
    if not isinstance(header, list | dict):
        return raw
    slots = _paths(header)
    if not slots:
        return raw
    container, key = draw(st.sampled_from(slots))
    action = draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "replace":
        container[key] = draw(plain)
    elif action == "delete":
        del container[key]
    elif isinstance(container, list):
        container.append(draw(plain))
    else:
        container[draw(st.text(max_size=6))] = draw(plain)
    try:
        return msgspec.msgpack.encode(header)
    except (TypeError, OverflowError):
        return raw


random_frames = st.lists(st.binary(max_size=128), min_size=0, max_size=10)


def _random_bytes_property(frames: list[bytes]) -> None:
    _decode_only_decode_error(frames)
    try:
        decode_arrays(frames)
    except DecodeError:
        pass


def _generic_property(frames: list[bytes]) -> None:
    try:
        arrays, fields = decode_arrays(frames)
    except DecodeError:
        return
    assert isinstance(arrays, dict) and isinstance(fields, dict)


@QUICK
@given(random_frames)
def test_random_bytes_quick(frames: list[bytes]) -> None:
    _random_bytes_property(frames)


@QUICK
@given(mutated())
def test_mutated_groups_quick(frames: list[bytes]) -> None:
    _decode_only_decode_error(frames)


@QUICK
@given(st.data())
def test_mutated_generic_quick(data: st.DataObject) -> None:
    frames = list(VALID_ARRAYS)
    frames[0] = _mutate_header(data.draw, frames[0])
    _generic_property(frames)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # ~5 min on an idle 2-core box; far longer on a loaded one
@SLOW
@given(random_frames)
def test_random_bytes_slow(frames: list[bytes]) -> None:
    _random_bytes_property(frames)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(SLOW, max_examples=100_000)
@given(mutated())
def test_mutated_groups_slow(frames: list[bytes]) -> None:
    _decode_only_decode_error(frames)

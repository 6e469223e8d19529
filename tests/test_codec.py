"""Codec round trips (every dtype and shape, frame count asserted) and its refusals."""

from __future__ import annotations

import msgpack
import msgspec
import numpy as np
import pytest

from asyncrl.transport import codec
from asyncrl.transport.codec import (
    NUMPY_DTYPES,
    DecodeError,
    EncodeError,
    decode_arrays,
    decode_group,
    encode_arrays,
    encode_group,
)
from asyncrl.types import NOT_GENERATED, TrajectoryGroup

torch = pytest.importorskip("torch")


def make_group(n: int = 3, seed: int = 0, advantages: bool = False) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 6, n)
    total = int(lengths.sum())
    mask = rng.integers(0, 2, total)
    return TrajectoryGroup(
        group_id=f"g{seed}",
        prompt_ids=rng.integers(0, 1000, 4),
        response_lengths=lengths,
        response_ids=rng.integers(0, 1000, total),
        rollout_logprobs=-rng.random(total),
        loss_mask=mask,
        versions=np.where(mask == 1, 3, NOT_GENERATED),
        rewards=rng.random(n),
        finish_reasons=["stop"] * n,
        advantages=rng.standard_normal(total) if advantages else None,
        metadata={"task": "t", "nested": {"k": [1, 2.5, None, True, b"raw"]}},
    )


def _header(frames: list) -> list:
    return msgspec.msgpack.decode(bytes(frames[0]))


def _reencode(frames: list, header: list) -> list:
    return [msgpack.packb(header), *frames[1:]]


# -- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("advantages", [False, True])
def test_group_round_trip_and_frame_count(advantages: bool) -> None:
    g = make_group(advantages=advantages)
    frames = encode_group(g)
    assert len(frames) == (9 if advantages else 8)  # header + one frame per array
    assert decode_group(frames) == g
    assert decode_group([bytes(memoryview(f)) for f in frames]) == g  # as bytes off the wire


def test_empty_group_round_trip() -> None:
    g = TrajectoryGroup.from_responses("empty", [], [])
    assert decode_group(encode_group(g)) == g


SHAPES = [(), (0,), (3,), (2, 0, 4), (2, 3), (4, 1, 2)]


@pytest.mark.parametrize("dtype", sorted(NUMPY_DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_numpy_round_trip_every_dtype_and_shape(dtype: str, shape: tuple) -> None:
    arr = (np.arange(int(np.prod(shape))) % 7).astype(dtype).reshape(shape)
    frames = encode_arrays({"a": arr, "b": arr}, {"x": 1})
    assert len(frames) == 3
    out, fields = decode_arrays(frames)
    assert fields == {"x": 1}
    for got in out.values():
        assert isinstance(got, np.ndarray) and got.dtype == arr.dtype and got.shape == arr.shape
        np.testing.assert_array_equal(got, arr)


TORCH_DTYPES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
    "float64", "complex64", "float8_e4m3fn", "float8_e5m2",
]  # fmt: skip


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_round_trip_every_dtype_and_shape(dtype: str, shape: tuple) -> None:
    t = (torch.arange(int(np.prod(shape))) % 7).to(getattr(torch, dtype)).reshape(shape)
    frames = encode_arrays({"t": t})
    assert len(frames) == 2
    (got,) = decode_arrays(frames)[0].values()
    assert isinstance(got, torch.Tensor) and got.dtype == t.dtype and got.shape == t.shape
    as_bytes = lambda x: x.reshape(-1).view(torch.uint8)  # noqa: E731  (bitwise: fp8 has no ==)
    assert torch.equal(as_bytes(got), as_bytes(t.contiguous()))


def test_non_contiguous_big_endian_and_large_arrays() -> None:
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    arrays = {
        "strided": base[::2, 1::3],
        "transposed": base.T,
        "big_endian": np.arange(5, dtype=">i8"),
        "torch_t": torch.randn(5, 7, dtype=torch.bfloat16).t(),
        "torch_slice": torch.arange(20.0)[::3],
        "large": np.random.default_rng(0).random(3_000_000),  # 24 MB
        "scalar": np.float64(2.5),
    }
    frames = encode_arrays(arrays)
    assert len(frames) == 1 + len(arrays)
    out, _ = decode_arrays(frames)
    for name, want in arrays.items():
        if isinstance(want, torch.Tensor):
            assert torch.equal(out[name], want)
        else:
            np.testing.assert_array_equal(out[name], want)
    assert out["big_endian"].dtype == np.int64


def test_torch_requires_grad_and_writable_result() -> None:
    t = torch.ones(3, requires_grad=True)
    (got,) = decode_arrays([bytes(memoryview(f)) for f in encode_arrays({"t": t})])[0].values()
    got += 1  # decoded tensors own writable memory even when the frame was read-only bytes
    assert got.tolist() == [2.0, 2.0, 2.0]


def test_fields_plain_values_round_trip() -> None:
    fields = {"s": "x", "i": -(2**63), "u": 2**64 - 1, "f": 1.5, "b": True, "n": None,
              "raw": b"\x00\xff", "l": [1, [2, {"k": "v"}]], "t": (1, 2), "np": np.int16(3)}  # fmt: skip
    _, out = decode_arrays(encode_arrays({}, fields))
    assert out == {**fields, "t": [1, 2], "np": 3}


# -- encode refusals ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("arrays", "fields", "match"),
    [
        ({"a": [1, 2]}, None, "expected numpy or torch"),
        ({"a": np.array(["x"])}, None, "not supported on the wire"),
        ({"a": np.array([object()])}, None, "not supported on the wire"),
        ({"a": np.zeros(2, "datetime64[s]")}, None, "not supported"),
        ({1: np.zeros(2)}, None, "array names must be str"),
        ({}, {"d": {1: 2}}, "map key 1 is not a str"),
        ({}, {"o": object()}, "object is not a plain wire value"),
        ({}, {"s": {1, 2}}, "set is not a plain wire value"),
        ({}, {"big": 2**64}, "cannot encode header"),
    ],
)
def test_encode_refuses_what_cannot_travel(arrays: dict, fields: dict | None, match: str) -> None:
    with pytest.raises(EncodeError, match=match):
        encode_arrays(arrays, fields)


def test_encode_refuses_oversized_and_bad_metadata() -> None:
    with pytest.raises(EncodeError, match="limit is 100"):
        encode_group(make_group(), max_bytes=100)
    with pytest.raises(EncodeError, match="frames, limit is 3"):
        encode_arrays({k: np.zeros(1) for k in "abc"}, max_frames=3)
    g = make_group()
    g.metadata["when"] = object()
    with pytest.raises(EncodeError, match=r"metadata.when: object"):
        encode_group(g)


# -- decode refusals ----------------------------------------------------------------------------
def test_wrong_schema_version_is_named() -> None:
    frames = encode_group(make_group())
    header = _header(frames)
    header[0] = 2
    with pytest.raises(DecodeError, match="schema version 2, this decoder reads version 1"):
        decode_group(_reencode(frames, header))
    with pytest.raises(DecodeError, match="schema version 2"):
        decode_arrays(_reencode(frames, header))
    # a future header shape that the typed decoder cannot even read still names its version
    with pytest.raises(DecodeError, match="schema version 3"):
        decode_group([msgpack.packb([3, "trajectory_group", {"new": 1}]), *frames[1:]])


def test_truncated_and_oversized_messages() -> None:
    frames = encode_group(make_group())
    with pytest.raises(DecodeError, match="bad header"):
        decode_group([bytes(frames[0])[:-3], *frames[1:]])
    with pytest.raises(DecodeError, match="bytes, .* needs"):
        decode_group([*frames[:3], bytes(memoryview(frames[3]))[:-1], *frames[4:]])
    with pytest.raises(DecodeError, match="belong to no array|side frames"):
        decode_group([*frames, b"extra"])
    with pytest.raises(DecodeError, match="missing or used twice|side frames"):
        decode_group(frames[:-1])
    with pytest.raises(DecodeError, match="limit is 64"):
        decode_group(frames, max_bytes=64)
    with pytest.raises(DecodeError, match="frames, limit is 4"):
        decode_group(frames, max_frames=4)
    with pytest.raises(DecodeError, match="header is"):
        decode_arrays([b"\x00" * (codec.MAX_HEADER_BYTES + 1)])


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda h: h.__setitem__(1, "other"), "expected a 'trajectory_group' message"),
        (lambda h: h[2].pop("rewards"), "missing \\['rewards'\\]"),
        (lambda h: h[2].__setitem__("extra", h[2].pop("rewards")), "unexpected \\['extra'\\]"),
        (lambda h: h[2]["versions"].__setitem__(1, "int64"), "expected 1-D numpy int32"),
        (lambda h: h[2]["versions"].__setitem__(0, "torch"), "expected 1-D numpy int32"),
        (lambda h: h[2]["versions"].__setitem__(2, [1, 2]), "expected 1-D numpy"),
        (lambda h: h[2]["versions"].__setitem__(3, 1), "missing or used twice"),
        (lambda h: h[2]["versions"].__setitem__(3, 0), "bad header"),
        (lambda h: h[3].pop("metadata"), "bad header"),
        (lambda h: h[3].__setitem__("more", 1), "bad header"),
        (lambda h: h[3].__setitem__("group_id", 5), "bad header"),
        (lambda h: h[3].__setitem__("finish_reasons", [1]), "bad header"),
        (lambda h: h[3].__setitem__("group_id", ""), "invalid trajectory group: group_id"),
        (lambda h: h[3].__setitem__("finish_reasons", []), "invalid trajectory group"),
        (lambda h: h.append(1), "bad header"),
        (lambda h: h.pop(), "bad header"),
    ],
)
def test_header_mutations_raise_decode_error(mutate: object, match: str) -> None:
    frames = encode_group(make_group())
    header = _header(frames)
    mutate(header)  # type: ignore[operator]
    with pytest.raises(DecodeError, match=match):
        decode_group(_reencode(frames, header))


def test_reused_frame_of_the_right_size_is_named() -> None:
    # response_ids (int32) and rollout_logprobs (float32) have the same byte size, so every
    # per-array check passes and only the frames-used-once rule refuses the message.
    frames = encode_group(make_group())
    header = _header(frames)
    header[2]["rollout_logprobs"][3] = header[2]["response_ids"][3]
    frame = header[2]["response_ids"][3]
    with pytest.raises(DecodeError, match=f"'rollout_logprobs': frame {frame} is missing or used"):
        decode_group(_reencode(frames, header))


def test_record_error_is_wrapped() -> None:
    g = make_group(n=2)
    frames = encode_group(g)
    bad_mask = np.full(g.num_tokens, 7, np.uint8)
    with pytest.raises(DecodeError, match="invalid trajectory group: .*loss_mask"):
        decode_group([*frames[:5], bad_mask, *frames[6:]])


def _wire_group(n: int) -> TrajectoryGroup:
    """n responses of 3 tokens each; the middle token of each is a tool token (mask 0,
    NOT_GENERATED). n > 32 takes the numpy branch of the small-array checks in types.py."""
    return TrajectoryGroup(
        group_id="w",
        prompt_ids=[1, 2],
        response_lengths=[3] * n,
        response_ids=np.arange(3 * n),
        rollout_logprobs=np.full(3 * n, -0.5),
        loss_mask=np.tile([1, 0, 1], n),
        versions=np.tile([2, NOT_GENERATED, 3], n),
        rewards=np.ones(n),
        finish_reasons=["stop"] * n,
        advantages=np.zeros(3 * n),
    )


INT32_MIN = int(np.iinfo(np.int32).min)


@pytest.mark.parametrize("n", [2, 40])
@pytest.mark.parametrize(
    ("field", "index", "value", "match"),
    [
        ("prompt_ids", 1, -1, "negative token id"),
        ("response_ids", -1, -7, "negative token id"),
        ("response_lengths", -1, -1, "negative response length"),
        ("response_lengths", -1, 4, "response_ids has .* tokens, response_lengths sum to"),
        ("loss_mask", 0, 2, "loss_mask must hold only 0 and 1"),
        ("loss_mask", 1, 1, "no generating version"),  # masked in, NOT_GENERATED
        ("versions", 0, NOT_GENERATED, "no generating version"),
        ("versions", 1, -2, "below NOT_GENERATED"),
        ("versions", 0, INT32_MIN, "below NOT_GENERATED"),  # masked in: version - mask wraps
        ("rollout_logprobs", -1, np.nan, "non-finite"),
        ("rollout_logprobs", 0, -np.inf, "non-finite"),
        ("rewards", -1, np.inf, "non-finite"),
        ("advantages", -1, np.nan, "non-finite"),
    ],
)
def test_decoder_enforces_every_value_invariant(
    n: int, field: str, index: int, value: float, match: str
) -> None:
    # The decoder builds groups without __post_init__; each rule must still reject the
    # message, with its own reason, when one value in one frame is wrong.
    frames = encode_group(_wire_group(n))
    assert decode_group(frames) == _wire_group(n)
    _, dtype, _, frame = _header(frames)[2][field]
    bad = np.frombuffer(frames[frame], dtype).copy()
    bad[index] = value
    frames[frame] = bad.view(np.uint8)
    with pytest.raises(DecodeError, match=f"invalid trajectory group: group w: .*{match}"):
        decode_group(frames)


def test_non_contiguous_and_unexportable_frames_are_decode_errors() -> None:
    frames = encode_group(make_group())
    strided = memoryview(bytes(2 * memoryview(frames[3]).nbytes))[::2]
    for index, bad in [(3, strided), (0, strided), (3, np.zeros(2, "datetime64[s]"))]:
        with pytest.raises(DecodeError, match=f"frame {index} .* is not a byte buffer"):
            decode_group([*frames[:index], bad, *frames[index + 1 :]])


def test_fields_replaced_after_construction_still_encode_or_are_refused() -> None:
    g = make_group(n=3, seed=1)
    again = make_group(n=3, seed=1)
    g.response_ids = np.repeat(g.response_ids, 2)[::2]  # strided: copied to contiguous bytes
    assert decode_group(encode_group(g)) == again
    g.versions = g.versions.astype(">i4")  # big-endian: byte-swapped on the way out
    assert decode_group(encode_group(g)) == again
    g.versions = g.versions.astype(np.int64)  # the wrong dtype travels, the decoder refuses it
    with pytest.raises(DecodeError, match="expected 1-D numpy int32"):
        decode_group(encode_group(g))


def test_ext_types_pickle_and_non_buffers_are_refused() -> None:
    frames = encode_group(make_group())
    header = _header(frames)
    header[3]["metadata"] = {"x": msgpack.ExtType(1, b"\x80\x04N.")}  # a pickle in an ext
    with pytest.raises(DecodeError, match="extension type 1"):
        decode_group(_reencode(frames, header))
    header[3]["metadata"] = {"t": msgpack.Timestamp(5)}
    with pytest.raises(DecodeError, match="not a plain wire value"):
        decode_group(_reencode(frames, header))
    with pytest.raises(DecodeError, match="not a byte buffer"):
        decode_group([frames[0], 3, *frames[2:]])
    for bad in ([], None, b"bytes-not-a-list"):
        with pytest.raises(DecodeError, match="non-empty list"):
            decode_group(bad)  # type: ignore[arg-type]


def test_generic_decode_refuses_bad_specs() -> None:
    ok = encode_arrays({"a": np.zeros(4, np.float32)})
    cases = {
        "unsupported array type numpy/object": ["numpy", "object", [4], 1],
        "unsupported array type cupy/float32": ["cupy", "float32", [4], 1],
        "needs 32": ["numpy", "float64", [4], 1],
        "dimensions, limit is 32": ["numpy", "uint8", [1] * 33, 1],
        "exceeds its frame": ["numpy", "uint8", [2**40, 2**40], 1],
        "this torch has no dtype|unsupported": ["torch", "float8_e8m0fnu", [4], 1],
    }
    for match, spec in cases.items():
        header = [1, "arrays", {"a": spec}, {}]
        with pytest.raises(DecodeError, match=match):
            decode_arrays([msgpack.packb(header), ok[1]])
    with pytest.raises(DecodeError, match="expected a 'weights' message"):
        decode_arrays(ok, kind="weights")
    deep = b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(DecodeError):
        decode_arrays([msgpack.packb([1, "arrays", {}, {}])[:-1] + b"\x81\xa1k" + deep])


def test_decode_error_is_one_bounded_line() -> None:
    frames = encode_group(make_group())
    header = _header(frames)
    header[3]["group_id\n" + "x" * 5000] = 1  # an unknown, hostile field name
    with pytest.raises(DecodeError) as info:
        decode_group(_reencode(frames, header))
    assert "\n" not in str(info.value) and len(str(info.value)) < 500

"""Several groups per message (`transport/batch.py`, `Sender.send_many`): exact round trips,
a batch accepted iff each of its groups would be, hostile batch headers refused with one
DecodeError, and delivery in order over real loopback sockets."""

from __future__ import annotations

import secrets
import threading
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import pytest

from asyncrl.transport.batch import (
    BATCH_KIND,
    MAX_BATCH_GROUPS,
    _array_bytes,
    chunk_groups,
    decode_groups,
    encode_batch,
    encode_groups,
)
from asyncrl.transport.batcher import SendBatcher
from asyncrl.transport.codec import (
    SCHEMA_VERSION,
    DecodeError,
    EncodeError,
    decode_group,
    encode_group,
)
from asyncrl.transport.sender import Sender, SenderConfig
from asyncrl.transport.zmq import (
    Receiver,
    ReceiverConfig,
    TransportTimeout,
)
from asyncrl.types import TrajectoryGroup

pytestmark = pytest.mark.timeout(120)


def make_group(seed: int, n: int = 3, advantages: bool = False) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 6, n)
    total = int(lengths.sum())
    return TrajectoryGroup(
        group_id=f"g{seed}",
        prompt_ids=rng.integers(0, 1000, int(rng.integers(0, 5))),
        response_lengths=lengths,
        response_ids=rng.integers(0, 1000, total),
        rollout_logprobs=-rng.random(total),
        loss_mask=rng.integers(0, 2, total).astype(np.uint8),
        versions=np.full(total, seed),
        rewards=rng.random(n),
        finish_reasons=["stop", "length", "abort"][:n] + ["stop"] * max(0, n - 3),
        advantages=rng.standard_normal(total) if advantages else None,
        metadata={"seed": seed, "nested": {"k": [1, "x", None]}},
    )


def _bytes(frames: list) -> list[bytes]:
    return [bytes(f) for f in frames]


def _header(frames: list) -> list:
    return msgspec.msgpack.decode(bytes(frames[0]))


def _with_header(frames: list, header: list) -> list[bytes]:
    return [msgspec.msgpack.encode(header), *_bytes(frames[1:])]


@pytest.mark.parametrize("advantages", [False, True])
def test_batch_round_trip_is_exact(advantages):
    groups = [make_group(s, n=s % 4, advantages=advantages) for s in range(9)]
    frames = encode_batch(groups)
    assert len(frames) == 1 + 7 + advantages  # one frame per field, however many groups
    assert _header(frames)[1] == BATCH_KIND
    out = decode_groups(_bytes(frames))
    assert len(out) == len(groups)
    for sent, got in zip(groups, out, strict=True):
        assert got == sent
        got._check()  # each decoded group is a valid record on its own


def test_one_group_keeps_the_single_group_layout():
    group = make_group(1)
    frames = encode_groups([group])
    assert _bytes(frames) == _bytes(encode_group(group))
    assert decode_groups(_bytes(frames)) == [group]
    assert decode_group(_bytes(frames)) == group


def test_batch_refuses_mixed_advantages_and_empty():
    with pytest.raises(EncodeError, match="all carry advantages or none"):
        encode_batch([make_group(1), make_group(2, advantages=True)])
    with pytest.raises(EncodeError, match="1 to 1024 groups, not 0"):
        encode_batch([])


def test_batch_encode_refuses_non_plain_metadata():
    bad = make_group(2)
    bad.metadata["obj"] = object()
    with pytest.raises(EncodeError, match="metadata.obj"):
        encode_batch([make_group(1), bad])


def _corrupt(field: str, index: int, value) -> list[bytes]:
    """A batch of 4 groups whose group 2 has `field[index] = value` (decoded frames edited)."""
    groups = [make_group(s, n=3) for s in range(4)]
    while len(groups[2].response_ids) < 2:  # the corruption needs a token to land on
        groups[2] = make_group(groups[2].metadata["seed"] + 100, n=3)
        groups[2].group_id = "g2"
    getattr(groups[2], field)[index] = value
    return _bytes(encode_batch(groups))


@pytest.mark.parametrize(
    "field, index, value, reason",
    [
        ("response_ids", 1, -5, "group g2: negative token id"),
        ("loss_mask", 0, 7, "group g2: loss_mask must hold only 0 and 1"),
        ("versions", 0, -3, "group g2: version below NOT_GENERATED"),
        ("rollout_logprobs", 1, np.nan, "group g2: non-finite logprob"),
        ("rewards", 0, np.inf, "group g2: non-finite logprob, reward or advantage"),
    ],
)
def test_bad_value_in_one_group_refuses_the_batch_naming_that_group(field, index, value, reason):
    """The vectorised check and a per-group decode give the same verdict and the same words."""
    frames = _corrupt(field, index, value)
    with pytest.raises(DecodeError, match=reason):
        decode_groups(frames)


def test_unversioned_token_with_mask_is_refused_in_a_batch():
    groups = [make_group(s) for s in range(3)]
    victim = next(g for g in groups if len(g.versions))
    victim.versions[0], victim.loss_mask[0] = -1, 1
    with pytest.raises(DecodeError, match=f"group {victim.group_id}: a token with loss_mask 1"):
        decode_groups(_bytes(encode_batch(groups)))


def _edit_fields(edit) -> list[bytes]:
    frames = encode_batch([make_group(s, n=3) for s in range(3)])
    header = _header(frames)
    edit(header[3])
    return _with_header(frames, header)


@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda f: f["group_ids"].pop(), "batch: 2 group ids but lists"),
        (lambda f: f["sizes"].__setitem__(0, 2), "batch: response_lengths has 9 entries, not 8"),
        (lambda f: f["sizes"].__setitem__(0, 2**41), "bad header"),
        (lambda f: f["sizes"].__setitem__(0, -1), "bad header"),
        (lambda f: f["prompt_lengths"].__setitem__(1, 99), "batch: prompt_ids has"),
        (lambda f: f["finish_reasons"][1].pop(), "3 responses but 2 finish_reasons"),
        (lambda f: f["group_ids"].__setitem__(1, ""), "empty id"),
        (lambda f: f.__setitem__("extra", 1), "bad header"),
        (lambda f: f["metadata"][0].__setitem__("x", {1: 2}), "map key 1 is not a str"),
        (lambda f: f["group_ids"].__setitem__(0, 7), "bad header"),
    ],
)
def test_hostile_batch_header_is_refused(edit, reason):
    with pytest.raises(DecodeError, match=reason):
        decode_groups(_edit_fields(edit))


def test_chunk_sizes_are_the_groups_array_bytes():
    groups = [make_group(s, n=s % 4, advantages=s % 2 == 1) for s in range(8)]
    assert [_array_bytes(g) for g in groups] == [g.nbytes for g in groups]


def test_batch_group_count_is_bounded():
    group = make_group(1, n=0)
    assert len(chunk_groups([group] * (MAX_BATCH_GROUPS + 1), 1 << 20)) == 2
    with pytest.raises(EncodeError, match="not 1025"):
        encode_batch([group] * (MAX_BATCH_GROUPS + 1))
    frames = encode_batch([group] * 2)
    header = _header(frames)
    for key in ("group_ids", "finish_reasons", "metadata", "prompt_lengths", "sizes"):
        header[3][key] = header[3][key][:1] * (MAX_BATCH_GROUPS + 1)
    with pytest.raises(DecodeError, match="batch: 1025 group ids"):
        decode_groups(_with_header(frames, header))


def test_negative_response_length_in_a_batch_names_the_group():
    frames = encode_batch([make_group(s, n=3) for s in range(3)])
    raw = _bytes(frames)
    header = _header(frames)
    lengths = np.frombuffer(raw[header[2]["response_lengths"][3]], np.int32).copy()
    ids = header[3]["group_ids"]
    lengths[4], lengths[5] = -1, lengths[5] + lengths[4] + 1  # same total: only the sign is off
    raw[header[2]["response_lengths"][3]] = lengths.tobytes()
    with pytest.raises(DecodeError, match=f"group {ids[1]}: negative response length"):
        decode_groups(raw)


def test_batch_frame_layout_is_checked_as_a_single_groups():
    frames = encode_batch([make_group(s) for s in range(3)])
    with pytest.raises(DecodeError, match="side frames"):
        decode_groups(_bytes(frames)[:-1])
    header = _header(frames)
    header[2]["response_ids"][1] = "float32"
    with pytest.raises(DecodeError, match="group array 'response_ids'"):
        decode_groups(_with_header(frames, header))
    header = _header(frames)
    header[0] = SCHEMA_VERSION + 1
    with pytest.raises(DecodeError, match="schema version"):
        decode_groups(_with_header(frames, header))


def test_ext_type_in_a_batch_header_is_refused():
    frames = encode_batch([make_group(s) for s in range(2)])
    header = _header(frames)
    header[3]["metadata"][0]["x"] = msgspec.msgpack.Ext(1, b"\x80")
    with pytest.raises(DecodeError, match="extension type"):
        decode_groups(_with_header(frames, header))


def test_random_corruption_of_a_batch_only_ever_raises_decode_error():
    frames = _bytes(encode_batch([make_group(s) for s in range(4)]))
    rng = np.random.default_rng(0)
    for _ in range(400):
        mutated = [bytearray(f) for f in frames]
        which = int(rng.integers(0, len(mutated)))
        if not mutated[which]:
            continue
        for _ in range(int(rng.integers(1, 4))):
            mutated[which][int(rng.integers(0, len(mutated[which])))] = int(rng.integers(0, 256))
        try:
            out = decode_groups([bytes(m) for m in mutated])
        except DecodeError:
            continue
        for group in out:  # whatever is accepted is a valid record
            group._check()


def test_send_many_delivers_every_group_in_order_over_zmq():
    secret = secrets.token_bytes(32)
    groups = [make_group(s, n=1 + s % 3) for s in range(20)]
    groups[7:9] = [make_group(50, advantages=True), make_group(51, advantages=True)]
    with Receiver(ReceiverConfig(secret=secret)) as receiver:
        config = SenderConfig(port=receiver.port, secret=secret, ready_timeout_s=30)
        with Sender(config) as sender:
            sender.send_many(groups)
            sender.send(make_group(99))
            got = [receiver.get(timeout_s=30) for _ in range(len(groups) + 1)]
        assert got == [*groups, make_group(99)]
        stats = receiver.stats()
        assert stats.received == len(groups) + 1 and stats.rejected == 0
        assert sender.sent == 4  # advantages start and stop: 3 batches, then one group


def test_send_many_splits_at_the_message_size_limit():
    groups = [make_group(s, n=3) for s in range(12)]
    limit = sum(g.nbytes for g in groups)  # send_many fills half of it with arrays: >= 2 messages
    with Receiver(ReceiverConfig(max_message_bytes=limit)) as receiver:
        config = SenderConfig(port=receiver.port, ready_timeout_s=30, max_message_bytes=limit)
        with Sender(config) as sender:
            sender.send_many(groups)
            got = [receiver.get(timeout_s=30) for _ in groups]
        assert got == groups and sender.sent > 1
        assert receiver.stats().rejected == 0


def test_a_refused_batch_loses_nothing_sent_after_it():
    with Receiver(ReceiverConfig()) as receiver:
        with Sender(SenderConfig(port=receiver.port, ready_timeout_s=30)) as sender:
            sender.send_frames(_corrupt("response_ids", 1, -5))
            sender.send_many([make_group(1), make_group(2)])
            assert receiver.get(timeout_s=30) == make_group(1)
            assert receiver.get(timeout_s=30) == make_group(2)
        stats = receiver.stats()
        assert stats.rejected == 1 and stats.received == 2
        assert "group g2: negative token id" in stats.last_error


def test_batcher_coalesces_a_backlog_and_completes_every_future():
    """Groups submitted while the send thread is busy leave in one message, in order."""
    busy, release = threading.Event(), threading.Event()
    with Receiver(ReceiverConfig()) as receiver, ThreadPoolExecutor(1) as pool:
        sender = pool.submit(Sender, SenderConfig(port=receiver.port, ready_timeout_s=30))
        sender = sender.result()
        batcher = SendBatcher(sender, pool)
        pool.submit(lambda: (busy.set(), release.wait(30)))  # the send thread is busy
        assert busy.wait(30)
        groups = [make_group(s) for s in range(10)]
        futures = [batcher.submit(g) for g in groups]
        release.set()
        sizes = {f.result(timeout=30) for f in futures}
        assert [receiver.get(timeout_s=30) for _ in groups] == groups
        assert sender.sent == 1 and len(sizes) == 1  # one message carried all ten
        pool.submit(sender.close).result()


def test_batcher_fails_only_the_group_that_cannot_be_encoded():
    with Receiver(ReceiverConfig()) as receiver, ThreadPoolExecutor(1) as pool:
        sender = pool.submit(Sender, SenderConfig(port=receiver.port, ready_timeout_s=30))
        sender = sender.result()
        batcher = SendBatcher(sender, pool)
        hold = threading.Event()
        pool.submit(hold.wait, 30)
        bad = make_group(5)
        bad.metadata["obj"] = object()
        futures = [batcher.submit(g) for g in (make_group(4), bad, make_group(6))]
        hold.set()
        with pytest.raises(EncodeError, match="metadata.obj"):
            futures[1].result(timeout=30)
        assert futures[0].result(timeout=30) > 0 and futures[2].result(timeout=30) > 0
        assert [receiver.get(timeout_s=30) for _ in range(2)] == [make_group(4), make_group(6)]
        pool.submit(sender.close).result()


def _big_group(seed: int, tokens: int = 1 << 17) -> TrajectoryGroup:
    return TrajectoryGroup(
        group_id=f"big{seed}",
        prompt_ids=np.zeros(4, np.int32),
        response_lengths=np.array([tokens], np.int32),
        response_ids=np.zeros(tokens, np.int32),
        rollout_logprobs=np.zeros(tokens, np.float32),
        loss_mask=np.ones(tokens, np.uint8),
        versions=np.zeros(tokens, np.int32),
        rewards=np.zeros(1, np.float32),
        finish_reasons=["stop"],
    )


def test_batcher_hands_a_timeout_to_every_unsent_group():
    with Receiver(ReceiverConfig(hwm=1)) as receiver, ThreadPoolExecutor(1) as pool:
        config = SenderConfig(port=receiver.port, hwm=1, send_timeout_s=0.2, ready_timeout_s=30)
        sender = pool.submit(Sender, config).result()
        batcher = SendBatcher(sender, pool, max_groups=4)
        big = [_big_group(s) for s in range(40)]  # 40 MB; the receiver never reads: pipes fill
        futures = [batcher.submit(g) for g in big]
        errors = [f.exception(timeout=60) for f in futures]
        assert any(isinstance(e, TransportTimeout) for e in errors)
        assert all(e is None or isinstance(e, TransportTimeout) for e in errors)
        pool.submit(sender.close).result()
        assert receiver.stats().rejected == 0

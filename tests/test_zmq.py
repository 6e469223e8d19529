"""The ZMQ channel over real loopback sockets: integrity, no loss or duplication, backpressure,
the READY handshake, counters and rejection of malformed messages."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import secrets
import socket
import threading
import time

import numpy as np
import pytest
import zmq

from asyncrl.transport.auth import Credentials, needs_curve
from asyncrl.transport.codec import EncodeError, decode_group, encode_group
from asyncrl.transport.sender import Sender, SenderConfig
from asyncrl.transport.zmq import (
    PING,
    Receiver,
    ReceiverConfig,
    ReceiverError,
    TransportTimeout,
)
from asyncrl.types import TrajectoryGroup
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(120)


def _checksum(g: TrajectoryGroup) -> str:
    h = hashlib.sha256()
    for a in (g.prompt_ids, g.response_lengths, g.response_ids, g.rollout_logprobs, g.loss_mask,
              g.versions, g.rewards):  # fmt: skip
        h.update(a.tobytes())
    return h.hexdigest()


def make_group(sender: int, seq: int, tokens: int = 64) -> TrajectoryGroup:
    """A group whose metadata names its sender, sequence number and content checksum."""
    rng = np.random.default_rng(sender * 100_003 + seq)
    n = 4
    lengths = np.full(n, tokens // n)
    g = TrajectoryGroup(
        group_id=f"s{sender}-{seq}",
        prompt_ids=rng.integers(0, 50_000, 16),
        response_lengths=lengths,
        response_ids=rng.integers(0, 50_000, tokens),
        rollout_logprobs=-rng.random(tokens),
        loss_mask=np.ones(tokens, np.uint8),
        versions=np.full(tokens, seq),
        rewards=rng.random(n),
        finish_reasons=["stop"] * n,
        metadata={"sender": sender, "seq": seq},
    )
    g.metadata["sha"] = _checksum(g)
    return g


def _send_all(port: int, sender: int, count: int) -> None:
    with Sender(SenderConfig(port=port, hwm=8, send_timeout_s=60)) as s:
        for seq in range(count):
            s.send(make_group(sender, seq, tokens=64 + 8 * (seq % 5)))
        # linger=0 discards what is still queued on close; stay until the receiver has it all.
        time.sleep(1.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_many_senders_threads_and_processes_nothing_lost_or_duplicated() -> None:
    threads, procs, count = 3, 2, 150
    with Receiver(ReceiverConfig(hwm=8)) as rx:
        workers = [threading.Thread(target=_send_all, args=(rx.port, i, count)) for i in range(threads)]  # fmt: skip
        ctx = multiprocessing.get_context("spawn")
        workers += [ctx.Process(target=_send_all, args=(rx.port, threads + i, count)) for i in range(procs)]  # fmt: skip
        for w in workers:
            w.start()
        seen: dict[int, list[int]] = {}
        for _ in range((threads + procs) * count):
            g = rx.get(timeout_s=60)
            assert g.metadata["sha"] == _checksum(g), f"{g.group_id} corrupted in transit"
            seen.setdefault(g.metadata["sender"], []).append(g.metadata["seq"])
        for w in workers:
            w.join(timeout=60)
        with pytest.raises(TransportTimeout):
            rx.get(timeout_s=0.3)
        stats = rx.stats()
    # every id exactly once, and each sender's stream in order (one connection is FIFO)
    assert {s: seqs for s, seqs in seen.items()} == {
        s: list(range(count)) for s in range(threads + procs)
    }
    assert stats.received == (threads + procs) * count and stats.rejected == 0
    assert stats.pings == threads + procs


def test_backpressure_blocks_then_times_out_and_loses_nothing() -> None:
    big = 40_000  # ~0.5 MB per message, so kernel socket buffers fill after a few dozen
    with Receiver(ReceiverConfig(hwm=2)) as rx:  # nobody calls get: stalled
        with Sender(SenderConfig(port=rx.port, hwm=2, send_timeout_s=0.25)) as tx:
            accepted = 0
            with pytest.raises(TransportTimeout, match="send blocked"):
                for seq in range(1000):
                    started = time.monotonic()
                    tx.send(make_group(0, seq, tokens=big))
                    accepted += 1
            assert time.monotonic() - started >= 0.2  # it blocked, then gave up
            assert 0 < accepted < 1000
            assert rx.stats().received == 0  # held by libzmq and the kernel, not read ahead
            got = [rx.get(timeout_s=30) for _ in range(accepted)]
            assert [g.metadata["seq"] for g in got] == list(range(accepted))
            assert all(g.metadata["sha"] == _checksum(g) for g in got)
            with pytest.raises(TransportTimeout):
                rx.get(timeout_s=0.3)  # the timed-out message was not half-sent
            tx.send(make_group(0, accepted, tokens=16))  # the channel works again
            assert rx.get(timeout_s=10).metadata["seq"] == accepted


def test_ready_handshake_times_out_without_receiver() -> None:
    port = _free_port()
    started = time.monotonic()
    with pytest.raises(TransportTimeout, match="did not become ready"):
        Sender(SenderConfig(port=port, ready_timeout_s=0.3))
    assert 0.25 <= time.monotonic() - started < 5


def test_sender_started_first_waits_for_receiver() -> None:
    port = _free_port()
    result: dict[str, object] = {}

    def connect() -> None:
        try:
            tx = Sender(SenderConfig(port=port, ready_timeout_s=20))
            result["ready_at"] = time.monotonic()
            tx.send(make_group(1, 0))
            time.sleep(0.5)
            tx.close()
        except Exception as e:  # surfaced by the assertion below
            result["error"] = e

    t = threading.Thread(target=connect)
    t.start()
    time.sleep(0.5)
    assert "ready_at" not in result and "error" not in result  # still waiting
    receiver_up = time.monotonic()
    with Receiver(ReceiverConfig(port=port)) as rx:
        assert rx.get(timeout_s=20).group_id == "s1-0"
        t.join(timeout=20)
        assert rx.stats().pings == 1
    assert "error" not in result and result["ready_at"] >= receiver_up  # type: ignore[operator]


def test_malformed_message_rejected_and_counted_while_good_ones_flow(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="asyncrl.transport.zmq")
    with Receiver(ReceiverConfig()) as rx, Sender(SenderConfig(port=rx.port)) as tx:
        sizes = [tx.send(make_group(0, 0))]
        sizes.append(tx.send_frames([b"\x93\x01\x02", b"junk"]))
        sizes.append(tx.send(make_group(0, 1)))
        assert [rx.get(timeout_s=10).metadata["seq"] for _ in range(2)] == [0, 1]
        stats = rx.stats()  # the junk was read (and rejected) by the get that returned seq 1
    assert (stats.received, stats.rejected, stats.pings) == (2, 1, 1)
    assert stats.bytes == sum(sizes) + len(PING) == tx.bytes_sent + len(PING)
    assert stats.last_error and "bad header" in stats.last_error
    rejected = [r for r in caplog.records if "rejected message" in r.getMessage()]
    assert len(rejected) == 1 and "\n" not in rejected[0].getMessage()


def test_get_with_zero_timeout_takes_what_is_already_there() -> None:
    with Receiver(ReceiverConfig()) as rx, Sender(SenderConfig(port=rx.port)) as tx:
        tx.send(make_group(0, 7))
        deadline = time.monotonic() + 10
        while True:  # a zero timeout never waits, but it does read a message libzmq holds
            try:
                group = rx.get(timeout_s=0)
                break
            except TransportTimeout:
                assert time.monotonic() < deadline, "get(timeout_s=0) never read the message"
                time.sleep(0.01)
        assert group.metadata["seq"] == 7 and rx.stats().pings == 1


def test_decoder_bug_propagates_from_get_then_receiver_stays_broken() -> None:
    def decode(frames):  # a decoder with a bug: anything but DecodeError breaks the receiver
        group = decode_group(frames)
        if group.metadata["seq"] == 1:
            raise KeyError("decoder bug")
        return group

    with Receiver(ReceiverConfig(), decode=decode) as rx, Sender(SenderConfig(port=rx.port)) as tx:
        for seq in range(3):
            tx.send(make_group(0, seq))
        assert rx.get(timeout_s=10).metadata["seq"] == 0
        with pytest.raises(KeyError, match="decoder bug"):  # the decoder's own exception
            rx.get(timeout_s=10)
        # seq 1 is lost, so the receiver refuses to go on as if nothing happened
        with pytest.raises(ReceiverError, match="decoder bug"):
            rx.get(timeout_s=0)
        assert rx.stats().received == 1


def test_close_wakes_a_blocked_get_and_concurrent_gets_share_the_stream() -> None:
    rx = Receiver(ReceiverConfig(poll_interval_s=0.05))
    count, got, errors = 200, [], []

    def consume() -> None:  # two consumers; every record reaches exactly one of them
        while True:
            try:
                got.append(rx.get(timeout_s=None).metadata["seq"])
            except ReceiverError as e:
                errors.append(e)
                return

    consumers = [threading.Thread(target=consume) for _ in range(2)]
    for c in consumers:
        c.start()
    with Sender(SenderConfig(port=rx.port)) as tx:
        for seq in range(count):
            tx.send(make_group(0, seq))
        deadline = time.monotonic() + 30
        while len(got) < count and time.monotonic() < deadline:
            time.sleep(0.01)
    assert sorted(got) == list(range(count))
    closing = time.monotonic()
    rx.close()  # both consumers are now waiting forever in get
    for c in consumers:
        c.join(timeout=5)
    assert time.monotonic() - closing < 2 and not any(c.is_alive() for c in consumers)
    assert len(errors) == 2 and all("closed" in str(e) for e in errors)


def test_closed_receiver_and_oversized_send() -> None:
    rx = Receiver(ReceiverConfig(max_message_bytes=1 << 20))
    assert rx.address.startswith("tcp://127.0.0.1:") and rx.port > 0
    with Sender(SenderConfig(port=rx.port, max_message_bytes=1000)) as tx:
        with pytest.raises(EncodeError, match="limit is 1000"):
            tx.send(make_group(0, 0, tokens=400))
        with pytest.raises(EncodeError, match="exceeds 1000"):
            tx.send_frames([b"x" * 1001])
        assert tx.sent == 0
    rx.close()
    with pytest.raises(ReceiverError, match="closed"):
        rx.get(timeout_s=1)
    with pytest.raises(OSError, match="cannot bind"):
        Receiver(ReceiverConfig(host="203.0.113.7"))  # not an address of this machine


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_authenticated_stream_costs_no_byte_and_refused_peers_are_never_read(curve, caplog):
    """Good senders' groups all arrive and carry nothing extra; a peer without the secret is
    refused at the handshake: not one of its messages is read (no bytes, no decode), each
    refusal is counted, and the log is rate-limited and shows no secret."""
    caplog.set_level(logging.WARNING, logger="asyncrl.transport.zmq")
    secret = secrets.token_bytes(32)
    config = ReceiverConfig(secret=secret, curve=curve)
    with (
        Receiver(config) as rx,
        Sender(SenderConfig(port=rx.port, secret=secret, curve=curve)) as tx,
    ):
        for seq in range(3):
            tx.send(make_group(0, seq))
        assert [rx.get(timeout_s=10).metadata["seq"] for _ in range(3)] == [0, 1, 2]
        attackers = _raw_attackers(curve)
        for what, sock in attackers.items():  # one at a time: each must be refused itself
            before = rx.stats().unauthenticated
            sock.connect(rx.address)
            for _ in range(5):  # queued on the attacker's side, pushed if it ever got in
                _try_send(sock, [b"x"] * 20)
                _try_send(sock, encode_group(make_group(9, 0)))
            wait_for(lambda n=before: rx.stats().unauthenticated > n, f"refusal of {what}")
            sock.close(linger=0)
        tx.send(make_group(0, 3))
        assert rx.get(timeout_s=10).metadata["seq"] == 3
        with pytest.raises(TransportTimeout):
            rx.get(timeout_s=0.3)  # nothing of the attackers' was ever queued for reading
        stats = rx.stats()
    assert (stats.received, stats.rejected, stats.pings) == (4, 0, 1)
    assert stats.bytes == tx.bytes_sent + len(PING)  # no MAC frame, no byte per message
    assert stats.unauthenticated >= len(attackers)
    assert stats.last_error.startswith("unauthenticated: ")
    counts = [int(r.getMessage().split("#")[1].split()[0]) for r in caplog.records]
    assert counts and all(n & (n - 1) == 0 for n in counts)  # the 1st, 2nd, 4th, ...
    assert not any(secret.hex() in r.getMessage() or repr(secret) in r.getMessage()
                   for r in caplog.records)  # fmt: skip


def _try_send(sock: zmq.Socket, frames: list) -> None:
    """Queue a message if the socket has a pipe for it (once refused, it has none: a bare
    PUSH socket then blocks)."""
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        pass


def _raw_attackers(curve: bool) -> dict[str, zmq.Socket]:
    """Bare PUSH sockets, not connected yet, with no or made-up credentials (no IMMEDIATE:
    they queue messages and would push them the moment a handshake let them in)."""
    ctx = zmq.Context.instance()
    made_up = Credentials.from_secret(secrets.token_bytes(32))
    out = {"no credentials": ctx.socket(zmq.PUSH), "made-up credentials": ctx.socket(zmq.PUSH)}
    made_up.secure_client(out["made-up credentials"], curve)
    out["the other mechanism"] = ctx.socket(zmq.PUSH)
    made_up.secure_client(out["the other mechanism"], not curve)
    return out


def test_curve_unless_the_receiver_binds_loopback() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert not needs_curve(host), host  # PLAIN: its password only crosses loopback
    for host in ("0.0.0.0", "*", "::", "10.1.2.3", "192.168.0.7", "node-3.cluster"):
        assert needs_curve(host), host  # a routable network: CURVE (authenticated, encrypted)


@pytest.mark.parametrize(
    ("curve", "why"), [(False, "wrong user or password"), (True, "unknown client key")]
)
def test_the_refusal_names_the_reason_and_the_peer(curve: bool, why: str) -> None:
    secret = secrets.token_bytes(32)
    with Receiver(ReceiverConfig(secret=secret, curve=curve)) as rx:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        Credentials.from_secret(secrets.token_bytes(32)).secure_client(sock, curve)
        if curve:  # it knows the receiver's public key, not the run's client key
            sock.curve_serverkey = Credentials.from_secret(secret).server_public
        sock.connect(rx.address)
        wait_for(lambda: rx.stats().unauthenticated, "the refusal")
        sock.close(linger=0)
        stats = rx.stats()
    assert stats.last_error == f"unauthenticated: credentials refused: {why} (peer 127.0.0.1)"

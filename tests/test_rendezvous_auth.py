"""The weight-update rendezvous: a local process without the group's secret cannot forge it.

The TCPStore itself stays open (any local process can connect, list and write); what a sealed
group adds is that every value a rank reads must carry the secret's HMAC, so an outsider's
write makes the join fail instead of steering a rank to the outsider.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from asyncrl.net import free_port
from asyncrl.weights import group as wg


def _host(
    name: str, port: int, world: int, out: dict, done: threading.Event, timeout_s: float = 20
) -> threading.Thread:
    """Rank 0 joining in a thread; its group or its error lands in `out`, then `done` is set."""

    def run() -> None:
        try:
            out["pg"] = wg.create_group("gloo", "127.0.0.1", port, 0, world, name, timeout_s)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out["error"] = e
        finally:
            done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _outsider(port: int) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", port, 1, False, timeout=datetime.timedelta(seconds=10),
        wait_for_workers=False,
    )  # fmt: skip


def _keys_appear(store: dist.TCPStore, deadline_s: float = 20.0) -> list[str]:
    """Wait (bounded) until rank 0 has written its rendezvous keys."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        keys = store.list_keys()
        if keys:
            return keys
        time.sleep(0.02)  # polling the store's state under a deadline, not a fixed wait
    raise AssertionError("rank 0 never wrote its rendezvous keys")


def test_sealed_group_forms_and_its_keys_do_not_reveal_the_secret() -> None:
    name, port, out, done = wg.sealed_group_name(), free_port(), {}, threading.Event()
    _host(name, port, 2, out, done)
    outsider = _outsider(port)
    keys = _keys_appear(outsider)
    secret = name.removeprefix(wg.SEALED_PREFIX)
    assert all(secret not in k and name not in k for k in keys)
    pg = wg.create_group("gloo", "127.0.0.1", port, 1, 2, name, timeout_s=20)
    assert done.wait(20) and "error" not in out
    t0, t1 = torch.arange(4.0), torch.zeros(4)
    sender = threading.Thread(target=wg.broadcast, args=([t0], out["pg"]))
    sender.start()
    wg.broadcast([t1], pg)
    sender.join(20)
    assert torch.equal(t1, t0)
    for g in (pg, out["pg"]):
        wg.destroy_group(g)


def test_an_outsiders_write_to_a_rendezvous_key_fails_the_join_instead_of_steering_it() -> None:
    name, port, out, done = wg.sealed_group_name(), free_port(), {}, threading.Event()
    _host(name, port, 2, out, done, timeout_s=6)
    outsider = _outsider(port)
    for key in _keys_appear(outsider):
        # what a forger would do: replace rank 0's address with its own
        outsider.set(key, b"forged by a process without the secret")
    with pytest.raises(wg.GroupError, match="failed authentication") as err:
        wg.create_group("gloo", "127.0.0.1", port, 1, 2, name, timeout_s=5)
    assert name.removeprefix(wg.SEALED_PREFIX) not in str(err.value)  # never in a message
    # Rank 0 (a daemon thread) gives up at its own 6 s timeout; it may first have paired with
    # the genuine rank 1, never with the forger. Nothing here waits for it.


def test_sealed_values_are_refused_under_another_key_or_another_secret() -> None:
    port = free_port()
    raw = dist.TCPStore(
        "127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10),
        wait_for_workers=False,
    )  # fmt: skip
    mine = wg.SealedStore(raw, b"a" * 32)
    mine.set("k", b"value")
    assert mine.get("k") == b"value"
    raw.set("moved", raw.get("k"))  # a sealed value replayed under another key
    with pytest.raises(wg.GroupError, match="failed authentication"):
        mine.get("moved")
    with pytest.raises(wg.GroupError, match="failed authentication"):
        wg.SealedStore(raw, b"b" * 32).get("k")


def test_plain_group_names_keep_sglangs_key_layout() -> None:
    """SGLang's engines meet a plain name's keys (`PrefixStore(group_name)`): unchanged."""
    port, out, done = free_port(), {}, threading.Event()
    _host("plain_group", port, 2, out, done)
    keys = _keys_appear(_outsider(port))
    assert all(k.startswith("plain_group/") for k in keys)
    pg = wg.create_group("gloo", "127.0.0.1", port, 1, 2, "plain_group", timeout_s=20)
    assert done.wait(20) and "error" not in out
    for g in (pg, out["pg"]):
        wg.destroy_group(g)


def test_a_sealed_name_on_nccl_is_refused_in_one_line() -> None:
    with pytest.raises(wg.GroupError, match="gloo only"):
        wg.create_group("nccl", "127.0.0.1", free_port(), 0, 2, wg.sealed_group_name(), 1)


def test_master_port_zero_picks_a_port_free_where_the_engines_connect(monkeypatch) -> None:
    """`weight_sync.master_port: 0` multi-node: a port taken on the node's routable address
    (free on loopback) is never picked; the TCPStore server would fail to listen there."""
    import socket

    from asyncrl.net import is_loopback, route_ip

    ip = route_ip("192.0.2.1")
    if is_loopback(ip):
        pytest.skip("this machine has no routable interface")
    with socket.socket() as taken:
        taken.bind((ip, 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ok = free_port(ip)
        # the OS's pick is the edge faked here: first the port taken on `ip`, then a free one
        picks = iter([busy, ok])
        monkeypatch.setattr(wg, "free_port", lambda host: next(picks))
        assert wg.rendezvous_port(ip) == ok


class _JoiningEngine:
    """The engine edge faked: it joins the sender's group with the real `create_group` (as the
    hf server does) and records the name it was given."""

    url = "http://engine"

    def __init__(self) -> None:
        self.names: list[str] = []
        self.groups: list = []

    async def init_weights_update_group(self, addr, port, offset, world, name, backend, timeout):
        import asyncio

        self.names.append(name)
        pg = await asyncio.to_thread(wg.create_group, backend, addr, port, offset, world, name, 20)
        self.groups.append(pg)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        wg.destroy_group(self.groups.pop())


@pytest.mark.parametrize("seal", [True, False])
def test_a_sealing_sender_forms_each_group_under_a_fresh_secret(seal: bool) -> None:
    import asyncio

    from asyncrl.weights.sync import WeightSender

    async def go() -> list[str]:
        engine, sender = _JoiningEngine(), WeightSender(timeout_s=20, seal=seal)
        for _ in range(2):  # a heal re-forms the group
            await sender.init_group([engine], "127.0.0.1", None, "gloo", 20)
        await sender.close()
        return engine.names

    first, second = asyncio.run(go())
    if seal:
        assert first.startswith(wg.SEALED_PREFIX) and second.startswith(wg.SEALED_PREFIX)
        assert first != second  # a name seen once is worth nothing at the next formation
    else:
        assert first == second == "asyncrl_weights"  # SGLang's engines: the plain layout


@pytest.mark.slow  # launches an engine server (~30 s idle box, minutes on a loaded one)
def test_a_sealed_sync_into_a_real_hf_engine_updates_its_weights(tmp_path) -> None:
    """End to end: asyncrl's own engine server joins a sealed group (the name arrives in the
    authenticated /init_weights_update_group) and serves the weights sent through it."""
    import asyncio

    from asyncrl.engine.client import EngineClient
    from asyncrl.engine.hf.launch import launch_hf_server
    from asyncrl.weights.sync import WeightSender
    from tests.test_weight_sync import greedy_matches, make_tiny_model

    make_tiny_model(tmp_path, seed=0)
    handle = launch_hf_server(tmp_path, dtype="fp32", extra_args=["--num-threads", "1"])

    async def go() -> None:
        async with EngineClient(handle.url, timeout=30) as client:
            sender = WeightSender(timeout_s=20, seal=True)
            await sender.init_group([client], backend="gloo")
            assert sender.group_name.startswith(wg.SEALED_PREFIX)
            model = make_tiny_model(seed=1)
            await sender.sync(model.named_parameters(), 1, bucket_bytes=16_000)
            assert await greedy_matches(client, model) == "1"
            await sender.close()

    try:
        asyncio.run(go())
    finally:
        handle.stop()

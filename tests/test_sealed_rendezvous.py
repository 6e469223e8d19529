"""The learner ranks' rendezvous across nodes: a TCPStore whose values are sealed with a fresh
per-learner secret (`learner/placement.py:Rendezvous`), and the Megatron ranks' private file
store on one host. Real gloo joins in spawned processes, each bounded by a deadline; the only
edge faked is the node address (loopback here)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import secrets

import pytest
import torch.distributed as dist

from asyncrl.learner.placement import RankPlacement, Rendezvous
from asyncrl.net import free_port
from asyncrl.weights.group import GroupError, sealed_tcp_store

DEADLINE_S = 120


def _rank(meet: Rendezvous, rank: int, world: int, out) -> None:
    """One rank: join the default group through `meet`, all-reduce its rank, report the sum."""
    import torch

    try:
        meet.join(rank, world, "gloo")
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        # a later group calls into the store after `join` returned (it must still be alive)
        dist.all_reduce(t, group=dist.new_group(backend="gloo"))
        out.put((rank, float(t)))
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}"))


def _two_ranks(target, *args) -> dict[int, object]:
    """`target(*args, rank, out)` in 2 spawned processes; what each put, by rank (a deadline on
    every wait, stragglers killed)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, r, out)) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        return dict(out.get(timeout=DEADLINE_S) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _rank_of_two(meet: Rendezvous, rank: int, out) -> None:
    _rank(meet, rank, 2, out)


def test_two_ranks_meet_through_the_sealed_store_and_all_reduce():
    meet = Rendezvous("127.0.0.1", free_port("127.0.0.1"), secrets.token_bytes(32))
    assert _two_ranks(_rank_of_two, meet) == {0: 6.0, 1: 6.0}


def test_a_value_written_without_the_secret_fails_in_one_line():
    port, timeout = free_port("127.0.0.1"), datetime.timedelta(seconds=20)
    secret = secrets.token_bytes(32)
    host = sealed_tcp_store("127.0.0.1", port, 0, 2, secret, timeout)
    host.set("rank0/addr", b"10.0.0.1:1234")
    assert host.get("rank0/addr") == b"10.0.0.1:1234"
    assert host.clone().get("rank0/addr") == b"10.0.0.1:1234"  # a new connection, still sealed
    # another process that reaches the port: with another secret, its write is refused ...
    outsider = sealed_tcp_store("127.0.0.1", port, 1, 2, secrets.token_bytes(32), timeout)
    outsider.set("rank1/addr", b"6.6.6.6:1")
    with pytest.raises(GroupError, match="'rank1/addr' failed authentication") as e:
        host.get("rank1/addr")
    assert "\n" not in str(e.value)
    # ... and so is a raw value written straight into the TCPStore under the same key
    raw = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout)
    raw.set("asyncrl-learner/rank0/addr", b"6.6.6.6:2")
    with pytest.raises(GroupError, match="failed authentication"):
        host.get("rank0/addr")
    # a reader with the wrong secret cannot take the real value either
    with pytest.raises(GroupError):
        outsider.get("rank0/addr")


def test_a_short_secret_is_refused():
    with pytest.raises(GroupError, match="at least 16 bytes"):
        sealed_tcp_store("127.0.0.1", 1, 0, 2, b"short", datetime.timedelta(seconds=1))


def test_multinode_placement_seals_its_rendezvous_and_never_shows_the_secret():
    meet, private = RankPlacement(multinode=True).rendezvous()
    assert private is None and meet.port > 0 and len(meet.secret) == 32
    assert meet.secret.hex() not in repr(meet) and "secret" not in repr(meet)
    assert meet.url() == f"tcp://{meet.host}:{meet.port}" or meet.url().startswith("tcp://[")
    one_host, private = RankPlacement().rendezvous()
    try:
        assert one_host.host.startswith("file://") and one_host.secret == b"" and private
    finally:
        RankPlacement.cleanup(private)


def _megatron_rank(meet: Rendezvous, rank: int, out) -> None:
    """One Megatron rank's join (`build.init_distributed`, no Megatron needed for it)."""
    import torch

    from asyncrl.device import SPECS
    from asyncrl.learner.megatron.build import init_distributed

    try:
        init_distributed(SPECS["cpu"], rank, 2, meet, 0)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        out.put((rank, float(t)))
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}"))


def test_megatron_ranks_meet_in_the_private_file_store_and_a_lone_rank_needs_no_port():
    from asyncrl.device import SPECS
    from asyncrl.learner.megatron.build import init_distributed

    meet, private = RankPlacement().rendezvous()  # what MegatronLearner uses on one host
    try:
        assert _two_ranks(_megatron_rank, meet) == {0: 3.0, 1: 3.0}
    finally:
        RankPlacement.cleanup(private)
    with pytest.raises(ValueError, match="rank 1 of 2: a multi-rank learner needs a rendezvous"):
        init_distributed(SPECS["cpu"], 1, 2, None, 0)
    init_distributed(SPECS["cpu"], 0, 1, None, 0)  # an in-memory store: nothing to join
    try:
        assert dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()

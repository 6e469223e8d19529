"""A heal after an engine died during a sync's broadcast.

The learner's side of the broadcast fails at once (its connection to the dead engine closes);
a surviving engine's receive waits for bytes that will never come, and gloo cannot interrupt
that wait short of the group's timeout. The heal's destroy must abandon that receive, not queue
behind it: the new group then forms at once (it used to wait out the group timeout, which is
longer than the heal's own, and the run failed). Real servers, real gloo; the only thing the
tests arrange is when the engine dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import asyncrl.engine.hf.weights as receiver_module
from asyncrl.engine.client import EngineClient
from asyncrl.engine.hf.engine import HFEngine
from asyncrl.engine.hf.launch import spawn_hf_server, wait_healthy
from asyncrl.engine.hf.weights import WeightReceiver
from asyncrl.weights.buckets import dtype_name, flat_layout, flatten_bucket
from asyncrl.weights.group import (
    GroupError,
    broadcast,
    create_group,
    destroy_group,
    rendezvous_port,
)
from asyncrl.weights.sync import WeightSender, WeightSyncError
from tests.helpers import random_qwen2
from tests.test_weight_sync import greedy_matches, make_tiny_model

#: The survivor's stuck receive lasts this group timeout (+10 s), far longer than the destroy's
#: control timeout: a destroy that queued behind the receive would time out.
STUCK_S = 60.0
CONTROL_S = 10.0
REINIT_S = 10.0


def test_a_survivor_stuck_in_a_dead_peers_broadcast_joins_the_new_group(tmp_path):
    make_tiny_model(tmp_path, seed=0)
    handles = [spawn_hf_server(tmp_path, extra_args=["--num-threads", "1"]) for _ in range(2)]
    try:
        victim, survivor = (wait_healthy(h, 120.0) for h in handles)
        model = make_tiny_model(seed=31)

        async def go() -> None:
            gone = EngineClient(victim.url, control_timeout=CONTROL_S)
            alive = EngineClient(survivor.url, timeout=30, control_timeout=CONTROL_S)
            async with gone, alive:
                sender = WeightSender(group_name="heal", timeout_s=STUCK_S)
                # the victim is rank 1, so the broadcast fails on it before the survivor's turn
                await sender.init_group([gone, alive], backend="gloo")
                await gone.profile()  # known: a sync without a pause calls the victim only to send
                victim.kill()
                with pytest.raises(WeightSyncError, match="failed"):
                    await sender.sync(model.named_parameters(), 1, pause_mode=None)
                # the heal's destroy is answered at once: the receive it ends is abandoned
                reply = await alive.destroy_weights_update_group(sender.group_name)
                assert reply.endswith("(its receive in flight abandoned).")
                # the heal's new group, without the relaunch
                await sender.init_group([alive], backend="gloo", timeout_s=REINIT_S)
                await sender.sync(model.named_parameters(), 2)
                assert await greedy_matches(alive, model) == "2"
                await sender.close()

        asyncio.run(go())
    finally:
        for h in handles:
            h.kill()


def test_an_abandoned_receive_changes_nothing_when_its_bytes_come_late(monkeypatch):
    """The receive is abandoned while it waits, then the bytes arrive after all: the bucket is
    discarded (the model and its version unchanged, the group gone), not loaded."""
    engine = HFEngine(random_qwen2(seed=0), max_batch_size=2)
    receiver = WeightReceiver(engine)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    version_before = engine.weight_version
    receiving = threading.Event()

    def observed(*args, **kwargs):  # the real broadcast; the test only learns it has begun
        receiving.set()
        return broadcast(*args, **kwargs)

    monkeypatch.setattr(receiver_module, "broadcast", observed)
    port = rendezvous_port("127.0.0.1")
    with ThreadPoolExecutor(2) as pool:
        mine = pool.submit(create_group, "gloo", "127.0.0.1", port, 0, 2, "late", 30.0)
        joined = receiver.init_group("127.0.0.1", port, 1, 2, "late", "gloo", 30.0)
        assert joined[0], joined
        group = mine.result(timeout=60)
        named = [(n, p.detach() + 1.0) for n, p in random_qwen2(seed=1).named_parameters()]
        tensors = [t for _, t in named]
        meta = ([n for n, _ in named], [dtype_name(t.dtype) for t in tensors])
        shapes = [list(t.shape) for t in tensors]
        update = pool.submit(receiver.update, *meta, shapes, "late", "flattened_bucket", "7")
        assert receiving.wait(60), "the receive never began"
        assert receiver.abandon("late") == (
            True,
            "Succeeded to destroy custom process group (its receive in flight abandoned).",
        )
        total = flat_layout([t.dtype for t in tensors], [t.shape for t in tensors])[1]
        buf = flatten_bucket(tensors, torch.empty(total, dtype=torch.uint8))
        with contextlib.suppress(GroupError):  # sent, or refused by the shut-down group
            broadcast([buf], group)
        ok, message = update.result(timeout=60)
        destroy_group(group)
    assert (ok, message) == (
        False,
        "receive on group 'late' abandoned: the sender destroyed the group",
    )
    assert "late" not in receiver.groups and engine.weight_version == version_before
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, before[name]), name

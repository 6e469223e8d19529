"""The real WeightSender against receivers that join and read exactly as SGLang does.

tests/test_weight_sync.py covers bucketing, asyncrl's own layout round trip, the hf server's
loaded weights, stalls and failed joins. Here the receiving side is SGLang's: the group is
joined through `init_custom_process_group`'s key layout, tensor-parallel ranks are separate
processes at `rank_offset + tp_rank`, and a `flattened_bucket` is one *unpadded* uint8 buffer
sliced per tensor and viewed as its dtype. Every byte is checked on every rank (sha256), with
mixed dtypes, uneven tp sizes and a group re-formed under the same name (a heal).
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import multiprocessing as mp
import os
import sys
import urllib.request
from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl.engine import sglang as sl
from asyncrl.engine import sglang_process as sp
from asyncrl.engine.client import EngineClient
from asyncrl.net import free_port
from asyncrl.weights.buckets import flat_layout
from asyncrl.weights.group import _accelerator_group, broadcast, destroy_group
from asyncrl.weights.sync import WeightSender

FAKE = str(Path(__file__).parent / "fake_sglang")


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    ).hexdigest()


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        ("a.f32", torch.randn(5, 3, generator=g)),
        ("b.bf16", torch.randn(7, generator=g).to(torch.bfloat16)),  # 14 bytes: would misalign
        ("c.f32", torch.randn(3, generator=g)),
        ("d.i64", torch.arange(3)),
        ("e.u8", torch.arange(5, dtype=torch.uint8)),
        ("f.f16", torch.randn(9, generator=g).half()),
        ("g.f16", torch.randn(2, 2, generator=g).half()),
        ("h.f32", torch.randn(40, generator=g)),  # 160 bytes: a bucket of its own
    ]


def start_fake(tmp_path: Path, tp: int, model_dir: Path) -> object:
    env = {"PYTHONPATH": os.pathsep.join([FAKE, os.environ.get("PYTHONPATH", "")])}
    settings = sl.SGLangSettings.parse({"env": env})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = sl.server_command(model_dir, port, tp, settings)
    handle = sp.start_process(cmd, settings.env, url, tmp_path / f"fake_{port}.log")
    return sp.wait_healthy(handle, "/health_generate", 90, f"fake sglang tp={tp}")


def state(url: str) -> dict:
    with urllib.request.urlopen(url + "/_fake/state", timeout=10) as r:
        return json.loads(r.read())


def test_every_byte_on_every_rank_with_mixed_dtypes_and_uneven_tp(tmp_path):
    engines = [start_fake(tmp_path, tp, tmp_path) for tp in (1, 3)]
    named = mixed_tensors()

    async def go():
        clients = [EngineClient(h.url) for h in engines]
        sender = WeightSender(group_name="receiver_test", timeout_s=60)
        await sender.init_group(clients, backend="gloo", tp_sizes=[1, 3])
        flat = await sender.sync(named, 4, bucket_bytes=64, load_format="flattened_bucket")
        plain = await sender.sync(named, 5, bucket_bytes=64, load_format=None, pause_mode=None)
        cast = await sender.sync(named, 6, bucket_bytes=64, dtype=torch.bfloat16)
        await sender.close()
        for c in clients:
            await c.close()
        return flat, plain, cast

    try:
        flat, plain, cast = asyncio.run(go())
        got = [state(h.url) for h in engines]
    finally:
        for h in engines:
            h.stop()
    assert flat.tensors == plain.tensors == len(named) and flat.gb_per_s > 0
    inits = [[b for p, b in s["calls"] if p == "/init_weights_update_group"][0] for s in got]
    assert [(b["rank_offset"], b["world_size"]) for b in inits] == [(1, 5), (2, 5)]
    bf16 = {n: sha(t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in named}
    for s in got:
        assert s["violations"] == [] and s["version"] == "6"
        assert all(rank == bf16 for rank in s["received"])  # the last sync, on every rank
        updates = [b for p, b in s["calls"] if p == "/update_weights_from_distributed"]
        flat_calls = [b for b in updates if b["load_format"] == "flattened_bucket"]
        # one dtype per flattened bucket: SGLang's unpadded layout == asyncrl's aligned one
        for b in flat_calls:
            assert len(set(b["dtypes"])) == 1
            dtypes = [getattr(torch, d) for d in b["dtypes"]]
            offsets, total = flat_layout(dtypes, b["shapes"])
            sizes = [torch.Size(sh).numel() * torch.empty((), dtype=d).element_size()
                     for d, sh in zip(dtypes, b["shapes"])]  # fmt: skip
            assert offsets == [sum(sizes[:i]) for i in range(len(sizes))] and total == sum(sizes)
        names = [n for b in updates[: flat.buckets] for n in b["names"]]
        assert names == [n for n, _ in named]  # name order kept across buckets
    assert flat.buckets > 4  # dtype changes split buckets besides the size limit


# ---- the accelerator route (nccl / hccl) meets SGLang's init_custom_process_group ---------------
def _sglang_side(ports: list[int], name: str, conn) -> None:
    """SGLang's join (tcp rendezvous + PrefixStore(name) + torch's helper), once per port."""
    sys.path.insert(0, FAKE)
    from fake_ranks import _join

    out = []
    for port in ports:
        args = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "group_name": name, "backend": "gloo"}  # fmt: skip
        pg = _join(args, 0)
        t = torch.empty(6, dtype=torch.float16)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        pg.broadcast([t], opts).wait()
        out.append(sha(t))
        dist.destroy_process_group(pg)  # SGLang's destroy_weights_update_group
    conn.send(out)


def test_accelerator_route_rendezvous_matches_sglang_and_reforms_under_same_name():
    """`_accelerator_group` is the nccl/hccl path; run through torch's helper with gloo it
    meets SGLang's receiver key for key, twice under one name (destroy frees the name)."""
    ctx = mp.get_context("spawn")
    ports = [free_port(), free_port()]
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sglang_side, args=(ports, "weights_g", child), daemon=True)
    proc.start()
    timeout = datetime.timedelta(seconds=60)
    sent = []
    for i, port in enumerate(ports):
        store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout, wait_for_workers=False)
        pg = _accelerator_group("gloo", store, 0, 2, "weights_g", timeout)
        t = torch.arange(6, dtype=torch.float16) + i
        broadcast([t], pg)
        sent.append(sha(t))
        destroy_group(pg)
    assert parent.poll(60), "the SGLang-style receiver did not finish"
    assert parent.recv() == sent
    proc.join(10)

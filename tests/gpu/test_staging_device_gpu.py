"""GPU check (`pytest -m gpu tests/gpu`): the weight sync stages and communicates from the
learner's GPU, whichever it is, never from GPU 0 by default.

A fake SGLang engine (tp 1) on one GPU, the learner's weights on the other; the sync runs on a
fresh thread (whose current device is 0, as the control loop's is) with the device the learner
reports. Every bucket must arrive byte-exact (NCCL also refuses two ranks of one communicator
on one GPU), and this process must not have allocated a byte on the engine's GPU: the staging
buffers, and what the learner's export allocates on the current device (as Megatron's does),
all land on the learner's GPU. The CPU version of this check: tests/test_staging_device.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
FAKE = str(ROOT / "tests" / "fake_sglang")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def allocated(device: int) -> int:
    """Bytes this process's caching allocator ever handed out on `device` (a running sum)."""
    return torch.cuda.memory_stats(device).get("allocated_bytes.all.allocated", 0)


class Source:
    """A learner on `device`: its export allocates a scratch buffer on the current device,
    as Megatron's pipeline broadcast does, before yielding its weights."""

    version = 0

    def __init__(self, device: torch.device, named: list) -> None:
        self.sync_device, self.named, self.scratch = device, named, []

    def weights_for_sync(self):
        self.scratch.append(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
        yield from ((n, t.to(self.sync_device)) for n, t in self.named)


def run_in_fresh_thread(coro_fn) -> object:
    out: dict = {}

    def body() -> None:
        try:
            out["result"] = asyncio.run(coro_fn())
        except BaseException as e:  # handed to the test's thread
            out["error"] = e

    thread = threading.Thread(target=body, name="fresh-control-thread")
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive(), "the sync did not finish within 300 s"
    if "error" in out:
        raise out["error"]
    return out["result"]


@needs_two
@pytest.mark.parametrize(("learner_gpu", "engine_gpu"), [(1, 0), (0, 1)])
def test_staging_and_rank0_sit_on_the_learners_gpu(tmp_path, tiny_model, learner_gpu, engine_gpu):
    from asyncrl.config import load_config
    from asyncrl.device import SPECS
    from asyncrl.engine import sglang as sl
    from asyncrl.engine.client import EngineClient
    from asyncrl.weights.sync import WeightSender

    cfg = load_config(None, [])
    env = {"PYTHONPATH": os.pathsep.join([FAKE, os.environ.get("PYTHONPATH", "")])}
    cfg.actor_infer.strategy_args.strategy_config = {"env": env, "launch_timeout_s": 120}
    cfg.actor_infer.device_mapping = [engine_gpu]
    handle = sl.SGLangLauncher(cfg.actor_infer, tiny_model, tmp_path, 0, SPECS["cuda"]).launch(0)
    g = torch.Generator().manual_seed(learner_gpu)
    named = [
        (f"w{i}", torch.randn(4099 * (i + 1), generator=g).to(torch.bfloat16)) for i in range(6)
    ]
    source = Source(torch.device("cuda", learner_gpu), named)
    seen: dict = {}

    async def go() -> None:
        async with EngineClient(handle.url) as client:
            sender = WeightSender(group_name=f"staging_{learner_gpu}", timeout_s=120)
            await sender.init_group([client], backend="nccl", device=source.sync_device)
            seen["device"] = sender.device
            for version, fmt in ((1, "flattened_bucket"), (2, None)):
                await sender.sync(source.weights_for_sync(), version, bucket_bytes=1 << 16,
                                  load_format=fmt, device=source.sync_device)  # fmt: skip
            await sender.close()

    before = {d: allocated(d) for d in (learner_gpu, engine_gpu)}
    try:
        run_in_fresh_thread(go)
        with urllib.request.urlopen(handle.url + "/_fake/state", timeout=10) as r:
            state = json.loads(r.read())
    finally:
        handle.stop()
    want = {n: hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in named}
    assert state["violations"] == [] and state["received"] == [want] and state["version"] == "2"
    assert seen["device"] == torch.device("cuda", learner_gpu)
    assert all(s.device == source.sync_device for s in source.scratch)
    assert allocated(engine_gpu) == before[engine_gpu], "the sync allocated on the engine's GPU"
    bucket = 1 << 16  # at least one flattened bucket was staged on the learner's GPU
    assert allocated(learner_gpu) - before[learner_gpu] >= bucket

"""GPU-only checks of the production path (run with `pytest -m gpu tests/gpu`).

- the Megatron learner on a tiny Qwen2 (fp32, local layer spec): per-token logprobs, one
  step's loss metrics and the updated weights equal the torch learner's within tolerance;
- with two GPUs: the same at tensor-parallel size 2 (rank 1 a Ray actor), and an NCCL weight
  broadcast from the learner into an SGLang-style receiver on the other GPU, byte-exact;
- `bench/mfu.py --smoke` prints the MFU of a Megatron training step.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
FAKE = str(ROOT / "tests" / "fake_sglang")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def groups(seed: int = 0) -> list:
    from asyncrl.types import TrajectoryGroup

    rng = np.random.default_rng(seed)
    out = []
    for g in range(3):
        responses = []
        for i in range(4):
            length = int(rng.integers(2, 9))
            responses.append({
                "response_ids": rng.integers(5, 40, length), "reward": float(i % 2),
                "rollout_logprobs": -rng.random(length) * 3, "versions": np.zeros(length),
                "finish_reason": "stop", "advantages": np.full(length, 1.0 if i % 2 else -1.0),
            })  # fmt: skip
        out.append(TrajectoryGroup.from_responses(f"g{g}", rng.integers(5, 40, 3 + g), responses))
    return out


def configs(tp: int = 1, devices: str = "[0]"):
    from asyncrl.config import load_config

    common = ["actor_train.model_args.dtype=fp32", "actor_train.training_args.learning_rate=1e-3",
              "actor_train.model_args.disable_gradient_checkpointing=true",
              "actor_train.training_args.per_device_train_batch_size=3", "actor.entropy_coeff=0.01"]  # fmt: skip
    torch_cfg = load_config(None, common)
    meg = load_config(None, [*common, "actor_train.strategy_args.strategy_name=megatron_train",
                             f"actor_train.device_mapping={devices}"])  # fmt: skip
    meg.actor_train.strategy_args.strategy_config = {
        "tensor_model_parallel_size": tp, "transformer_impl": "local", "use_bridge": False,
    }  # fmt: skip
    return torch_cfg, meg


def compare_with_torch(model_dir: Path, tp: int, devices: str) -> None:
    pytest.importorskip("megatron.core")
    from asyncrl.learner.collate import collate
    from asyncrl.learner.logprobs import token_logprobs
    from asyncrl.learner.megatron.learner import MegatronLearner
    from asyncrl.learner.torch.learner import TorchLearner

    torch_cfg, meg_cfg = configs(tp, devices)
    ref = TorchLearner(model_dir, torch_cfg.actor_train, torch_cfg.actor, torch_cfg.algorithm,
                       temperature=0.7, total_steps=10, device="cuda")  # fmt: skip
    meg = MegatronLearner(model_dir, meg_cfg.actor_train, meg_cfg.actor, meg_cfg.algorithm,
                          temperature=0.7, total_steps=10)  # fmt: skip
    try:
        batch = groups()
        data = collate(sorted(batch, key=lambda g: g.group_id), ref.pad_id).to_torch("cuda")
        mask = data["response_mask"].bool()
        with torch.no_grad():
            want = token_logprobs(ref.model, data, 0.7)[0]
        got = meg.logprobs(batch)
        torch.testing.assert_close(got[mask], want[mask], atol=2e-5, rtol=1e-5)
        m_ref, m_meg = ref.step(batch), meg.step(batch)
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert m_meg[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-6), key
        after_ref = dict(ref.weights_for_sync())
        for name, tensor in meg.weights_for_sync():
            torch.testing.assert_close(
                tensor.float(), after_ref[name].float(), atol=1e-5, rtol=1e-4
            )
    finally:
        meg.close()


@needs_gpu
def test_megatron_learner_matches_torch_learner(tiny_model):
    compare_with_torch(tiny_model, tp=1, devices="[0]")


@needs_two
def test_megatron_learner_tp2_matches_torch_learner(tiny_model):
    compare_with_torch(tiny_model, tp=2, devices="[0,1]")


@needs_gpu
def test_mfu_bench_prints_the_mfu_of_a_step(tmp_path):
    pytest.importorskip("megatron.core")
    out = subprocess.run([sys.executable, "bench/mfu.py", "--smoke", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "MFU:" in out.stdout
    print(out.stdout)


@needs_two
def test_nccl_broadcast_into_sglang_style_receiver(tmp_path, tiny_model):
    """Learner on GPU 0 (rank 0), a fake SGLang engine (tp 1) on GPU 1 joined SGLang's way:
    every byte of every bucket arrives, flattened and per tensor, over NCCL."""
    from asyncrl.device import SPECS
    from asyncrl.engine import sglang as sl
    from asyncrl.engine.client import EngineClient
    from asyncrl.weights.sync import WeightSender

    torch.cuda.set_device(0)
    env = {"PYTHONPATH": os.pathsep.join([FAKE, os.environ.get("PYTHONPATH", "")])}
    cfg = configs()[1]
    cfg.actor_infer.strategy_args.strategy_config = {"env": env, "launch_timeout_s": 120}
    cfg.actor_infer.device_mapping = [1]
    launcher = sl.SGLangLauncher(cfg.actor_infer, tiny_model, tmp_path, 0, SPECS["cuda"])
    handle = launcher.launch(0)
    g = torch.Generator().manual_seed(0)
    named = [
        (f"w{i}", torch.randn(257 * (i + 1), generator=g).to(torch.bfloat16)) for i in range(6)
    ]

    async def go():
        async with EngineClient(handle.url) as client:
            sender = WeightSender(group_name="nccl_test", timeout_s=120)
            await sender.init_group([client], backend="nccl")
            for version, fmt in ((1, "flattened_bucket"), (2, None)):
                stats = await sender.sync(named, version, bucket_bytes=2048, load_format=fmt)
                print(
                    f"nccl sync {fmt}: {stats.bytes} B in {stats.seconds:.4f}s, {stats.gb_per_s:.3f} GB/s"
                )
            await sender.close()

    try:
        asyncio.run(go())
        with urllib.request.urlopen(handle.url + "/_fake/state", timeout=10) as r:
            state = json.loads(r.read())
    finally:
        handle.stop()
    want = {n: hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in named}
    assert state["violations"] == [] and state["received"] == [want] and state["version"] == "2"

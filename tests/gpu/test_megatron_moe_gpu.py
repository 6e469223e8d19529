"""GPU-only: the Megatron learner on the embedded tiny Qwen3-MoE (Megatron's MoE layers,
SequentialMLP experts on the local spec, NCCL) against the torch learner on one GPU, and with
expert parallelism 2 over two GPUs (rank 1 a Ray actor); with r3 (routes replayed through
megatron-core's router-replay hook) on one GPU. Run with `pytest -m gpu tests/gpu`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def compare(model_dir: Path, devices: str, extra: dict, replay: bool) -> None:
    pytest.importorskip("megatron.core")
    import megatron_moe_emulation as mm
    import test_megatron_gpu as g

    from asyncrl.learner.collate import collate
    from asyncrl.learner.logprobs import token_logprobs
    from asyncrl.learner.megatron.learner import MegatronLearner
    from asyncrl.learner.routing import replay as replaying
    from asyncrl.learner.torch.learner import TorchLearner

    torch_cfg, meg_cfg = g.configs(1, devices)
    meg_cfg.actor_train.strategy_args.strategy_config.update(extra)
    for cfg in (torch_cfg, meg_cfg):
        cfg.actor.optim.name = "sgd"  # weights after the step = lr x the gradients
        cfg.actor.router_replay = "r3" if replay else "off"
    ref = TorchLearner(model_dir, torch_cfg.actor_train, torch_cfg.actor, torch_cfg.algorithm,
                       temperature=0.7, total_steps=10, device="cuda")  # fmt: skip
    meg = MegatronLearner(model_dir, meg_cfg.actor_train, meg_cfg.actor, meg_cfg.algorithm,
                          temperature=0.7, total_steps=10)  # fmt: skip
    try:
        batch = g.groups()
        if replay:
            batch = mm.routes_for(batch, 2, 2, 8)
        data = collate(sorted(batch, key=lambda x: x.group_id), ref.pad_id).to_torch("cuda")
        mask = data["response_mask"].bool()
        with torch.no_grad(), replaying(ref.model, data.get("routes")):
            want = token_logprobs(ref.model, data, 0.7)[0]
        got = meg.logprobs(batch)
        torch.testing.assert_close(got[mask], want[mask], atol=2e-5, rtol=1e-5)
        m_ref, m_meg = ref.step(batch), meg.step(batch)
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert m_meg[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-6), key
        after = dict(meg.weights_for_sync())  # checkpoint names on both sides
        want_after = dict(ref.weights_for_sync())
        assert sorted(after) == sorted(want_after)
        for name, tensor in after.items():
            torch.testing.assert_close(tensor.float(), want_after[name].float(), atol=1e-6,
                                       rtol=1e-4)  # fmt: skip
    finally:
        meg.close()


@pytest.fixture
def moe_dir(tmp_path):
    import megatron_moe_emulation as mm

    return mm.tiny_moe(tmp_path / "moe")


@needs_gpu
def test_megatron_moe_matches_the_torch_learner(moe_dir):
    compare(moe_dir, "[0]", {}, replay=False)


@needs_two
def test_megatron_moe_ep2_matches_the_torch_learner(moe_dir):
    compare(moe_dir, "[0,1]", {"expert_model_parallel_size": 2}, replay=False)


@needs_gpu
def test_megatron_moe_r3_matches_the_torch_learner(moe_dir):
    compare(moe_dir, "[0]", {}, replay=True)

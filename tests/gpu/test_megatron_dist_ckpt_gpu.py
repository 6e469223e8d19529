"""The Megatron learner's sharded checkpoint on a CUDA GPU (`pytest -m gpu tests/gpu`): Megatron's
distributed checkpointing on CUDA tensors, the regular and the distributed optimizer (the
latter's `fully_reshardable` state, with Transformer Engine's fused Adam where it is installed:
the step kept in the parameter groups). One step, a checkpoint through the manager, a second step; resumed in
place through `find` + `apply`, the second step again: the same weights. The CPU emulation
covers other layouts and rank counts (tests/test_megatron_dist_checkpoint.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
@pytest.mark.parametrize("distributed", [False, True], ids=["float16-optimizer", "distributed"])
def test_a_megatron_checkpoint_resumes_the_next_step_on_a_gpu(tmp_path, tiny_model, distributed):
    pytest.importorskip("megatron.core")
    sys.path.insert(0, str(HERE))
    import test_megatron_gpu as g

    from asyncrl.checkpoint import Checkpointer
    from asyncrl.learner.megatron.learner import MegatronLearner

    _, cfg = g.configs(1, "[0]")
    cfg.actor_train.strategy_args.strategy_config["use_distributed_optimizer"] = distributed
    learner = MegatronLearner(tiny_model, cfg.actor_train, cfg.actor, cfg.algorithm, 0.7, 10)
    try:
        batch = g.groups()
        learner.step(batch)
        manager = Checkpointer(tmp_path / "run", ["model", "optimizer"])
        manager.save(1, learner, {})
        learner.step(batch)
        want = {n: t.float().cpu() for n, t in learner.weights_for_sync()}
        loaded, skipped = manager.find("auto")
        assert loaded is not None, skipped
        loaded.apply(learner, {"model", "optimizer"})
        learner.step(batch)
        for name, tensor in learner.weights_for_sync():
            # the tolerance of the GPU equality tests (test_megatron_gpu.py)
            torch.testing.assert_close(tensor.float().cpu(), want[name], atol=1e-5, rtol=1e-4)
    finally:
        learner.close()

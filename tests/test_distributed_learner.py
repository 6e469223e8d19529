"""Data-parallel torch learner (DDP over gloo, ranks as Ray actors) equals one process."""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.torch.distributed import DistributedTorchLearner
from tests.test_torch_learner import _groups, _learner


@pytest.mark.parametrize("extra", [[], ["actor.ppo_mini_batch_size=4", "actor.shuffle=true"]])
def test_two_ranks_match_one_process(tiny_model, extra):
    model_dir = tiny_model
    single = _learner(model_dir, *extra)
    kwargs = {
        "model_path": model_dir, "train": single.train, "actor": single.actor,
        "algorithm": single.algorithm, "temperature": 0.7, "total_steps": 10,
    }  # fmt: skip
    dist = DistributedTorchLearner(2, **kwargs)
    try:
        for seed in (0, 1):
            groups = _groups(seed=seed)
            m_single = single.step(groups)
            m_dist = dist.step(groups)
            assert m_dist["learner/world_size"] == 2.0
            assert m_dist["actor/pg_loss"] == pytest.approx(m_single["actor/pg_loss"], abs=1e-5)
        ref = dict(single.model.named_parameters())
        for name, p in dist.local.model.named_parameters():
            torch.testing.assert_close(p, ref[name], atol=1e-5, rtol=1e-4, msg=name)
        assert dist.version == 2
    finally:
        dist.close()

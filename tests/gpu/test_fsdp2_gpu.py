"""GPU-only checks of the FSDP2 learner (`fsdp2_train` over 2 GPUs of one node; run with
`pytest -m gpu tests/gpu`): each rank pinned to its `device_mapping` entry, NCCL for the
shards' collectives, gloo beside it for CPU ones.

- fp32: two ranks equal one process on one GPU (loss, grad norm, gathered weights) and hold
  about half the parameter + optimizer bytes each;
- bf16 (mixed precision policy: fp32 masters, bf16 compute, fp32 reduce) with packed
  micro-batches: the step trains (finite loss, weights move) and weight sync gathers bf16
  full tensors on rank 0's GPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def _pair(model_dir, *overrides):
    from asyncrl.config import load_config
    from asyncrl.learner.torch.distributed import DistributedTorchLearner
    from asyncrl.learner.torch.learner import TorchLearner

    cfg = load_config(None, [
        "actor_train.training_args.learning_rate=1e-3", "actor_train.device_mapping=[0,1]",
        "actor_train.model_args.disable_gradient_checkpointing=true", *overrides])  # fmt: skip
    common = dict(model_path=model_dir, train=cfg.actor_train, actor=cfg.actor,
                  algorithm=cfg.algorithm, temperature=0.7, total_steps=10)  # fmt: skip
    return (lambda: TorchLearner(**common, device="cuda:0")), (
        lambda: DistributedTorchLearner(2, **common)
    )


@needs_two
def test_two_gpu_fsdp2_ranks_equal_one_gpu_and_hold_half(tiny_model):
    from tests.test_fsdp2 import _state_bytes
    from tests.test_torch_learner import _groups

    one, two = _pair(tiny_model, "actor_train.model_args.dtype=fp32",
                     "actor_train.training_args.per_device_train_batch_size=1")  # fmt: skip
    batches = [_groups(n_groups=1, n=3, seed=seed) for seed in range(2)]
    single = one()
    expected = [single.step(groups) for groups in batches]
    want = {k: v.detach().cpu() for k, v in single.model.state_dict().items()}
    dist = two()
    try:
        assert str(next(dist.local.model.parameters()).device) == "cuda:0"
        for groups, m_single in zip(batches, expected, strict=True):
            m_dist = dist.step(groups)
            for key in ("actor/pg_loss", "actor/grad_norm"):
                assert m_dist[key] == pytest.approx(m_single[key], abs=1e-4), key
        for name, tensor in dist.weights_for_sync():
            torch.testing.assert_close(tensor.cpu(), want[name], atol=1e-4, rtol=1e-3, msg=name)
        assert _state_bytes(dist.local) <= 0.55 * _state_bytes(single)
    finally:
        dist.close()


@needs_two
def test_two_gpu_fsdp2_bf16_packed_trains(tiny_model):
    from tests.test_torch_learner import _groups

    _, two = _pair(tiny_model, "actor_train.model_args.dtype=bf16", "actor.use_dynamic_bsz=true",
                   "actor.ppo_max_token_len_per_gpu=64")  # fmt: skip
    dist = two()
    try:
        before = {k: v.float().cpu() for k, v in dist.weights_for_sync()}
        metrics = dist.step(_groups(n_groups=2, n=4, seed=0))
        assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
        after = dict(dist.weights_for_sync())
        assert {t.dtype for t in after.values() if t.is_floating_point()} == {torch.bfloat16}
        assert all(t.device.type == "cuda" for t in after.values())
        assert any(not torch.equal(after[k].float().cpu(), before[k]) for k in before)
    finally:
        dist.close()

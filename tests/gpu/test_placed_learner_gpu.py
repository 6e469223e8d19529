"""GPU-only check of the multi-node learner placement on one real GPU (`pytest -m gpu
tests/gpu/test_placed_learner_gpu.py`, under a minute): a local Ray head that owns the GPU,
`cluster.address` set to it, a learner of world size 1 through the placement code a
multi-node run uses (`run.reserve_learner` → `make_learner`: rank 0's GPU held by a holder
actor, its torch index in the driver from Ray's id): rank 0's device is the id Ray gave
the holder, and one training step runs there on CUDA. The Megatron learner (when megatron-core
is installed) takes the same path for its lone rank.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def gpu_head():
    """A local Ray head with this machine's first GPU, joined as a cluster (`cluster.address`)."""
    import ray
    from ray.cluster_utils import Cluster

    from asyncrl.net import init_ray

    ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "num_gpus": 1, "include_dashboard": False},
    )
    init_ray(cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _config(address: str, model_dir, out, *extra):
    from asyncrl.config import load_config

    return load_config(None, [
        f"cluster.address={address}", "cluster.bind_host=0.0.0.0",
        "rollout.transport_host=0.0.0.0", f"output_dir={out}",
        f"actor_train.model_args.model_name_or_path={model_dir}",
        "actor_train.training_args.learning_rate=1e-3", "actor_train.model_args.dtype=fp32",
        "actor_train.model_args.disable_gradient_checkpointing=true",
        *extra,
    ])  # fmt: skip


@needs_gpu
def test_rank_0_trains_on_the_gpu_ray_gave_its_holder(gpu_head, tiny_model, tmp_path):
    """fsdp2_train of world size 1 built as a run builds it (`run.reserve_learner`, then
    `make_learner` with the placement): its device is the GPU the holder got from Ray."""
    import contextlib

    import ray

    from asyncrl.learner.base import make_learner
    from asyncrl.learner.placed_ranks import torch_index
    from asyncrl.run import reserve_learner
    from tests.test_torch_learner import _groups

    cfg = _config(gpu_head.address, tiny_model, tmp_path)
    with contextlib.ExitStack() as stack:
        placement = reserve_learner(stack, cfg)  # frees the held GPU when the stack closes
        placed = placement.reserved["ranks"]
        assert placed.holder is not None and [s.node for s in placed.slots] == [0]
        held = ray.get(placed.holder.ids.remote("GPU"))
        assert held == [placed.rank0_device]
        learner = make_learner(
            "fsdp2_train", world_size=1, placement=placement, model_path=tiny_model,
            train=cfg.actor_train, actor=cfg.actor, algorithm=cfg.algorithm, temperature=0.7,
            total_steps=10,
        )  # fmt: skip
        device = f"cuda:{torch_index(held[0], 'GPU')}"
        assert str(next(learner.model.parameters()).device) == device
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        metrics = learner.step(_groups(seed=0))
        assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
        assert any(not torch.equal(p, before[n]) for n, p in learner.model.named_parameters())
    assert "ranks" not in placement.reserved  # released with the run's stack


@needs_gpu
def test_a_lone_megatron_rank_takes_the_held_gpu(gpu_head, tiny_model, tmp_path):
    pytest.importorskip("megatron.core")
    from asyncrl.learner.megatron.learner import MegatronLearner
    from asyncrl.learner.placed_ranks import torch_index
    from asyncrl.learner.placement import RankPlacement
    from tests.gpu.test_megatron_gpu import groups

    cfg = _config(gpu_head.address, tiny_model, tmp_path,
                  "actor_train.strategy_args.strategy_name=megatron_train",
                  "actor_train.device_mapping=[0]")  # fmt: skip
    cfg.actor_train.strategy_args.strategy_config = {"transformer_impl": "local",
                                                     "use_bridge": False}  # fmt: skip
    learner = MegatronLearner(tiny_model, cfg.actor_train, cfg.actor, cfg.algorithm, 0.7, 10,
                              placement=RankPlacement.from_config(cfg))  # fmt: skip
    try:
        assert learner._placed is not None and learner._placed.holder is not None
        index = torch_index(learner._placed.rank0_device, "GPU")
        assert learner.sync_device == torch.device("cuda", index)
        metrics = learner.step(groups())
        assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
    finally:
        learner.close()

"""LoRA on FSDP2 ranks (`actor_train.model_args.lora_rank` with several devices): the peft model
sharded whole, 2 gloo ranks equal 1 process (loss, KL to the adapter-off reference, grad norm,
the adapter and merged tensors a sync sends), and checkpoints move between rank counts."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from asyncrl.checkpoint import Checkpointer
from asyncrl.learner import lora
from tests.test_fsdp2 import _distributed
from tests.test_lora_learner import _learner
from tests.test_torch_learner import _groups

SETTINGS = [
    "actor_train.training_args.per_device_train_batch_size=1",
    "actor.use_kl_loss=true",  # reference: null -> the policy with its adapter off
    "actor.kl_loss_coef=0.5",
]


def _close(got, want: dict[str, torch.Tensor]) -> None:
    got = dict(got)
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert not isinstance(tensor, DTensor), name
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=1e-4, msg=name)


def _snapshot(learner) -> tuple[dict, dict]:
    """Copies: one process, the adapter's tensors are views of the live parameters."""
    copy = lambda tensors: {k: v.clone() for k, v in tensors}  # noqa: E731
    return copy(learner.adapter_for_sync()), copy(learner.weights_for_sync())


def test_lora_on_two_fsdp2_ranks_equals_one_process_and_checkpoints_across(tiny_model, tmp_path):
    """Micro-batches of 1 row over 3 rows (rank 1 pads with a zero-loss pass). Then a sharded
    save resumes into 1 process, and a 1-process save into 2 ranks: each next step equals the
    uninterrupted one (adapter and optimizer state restored); the HF export holds the merged
    model and a PEFT adapter that loads."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batches = [_groups(n_groups=1, n=3, seed=seed) for seed in range(4)]
    single = _learner(tiny_model, *SETTINGS)  # goes first: see test_fsdp2
    expected, states = [single.step(b) for b in batches[:3]], []
    one_proc = Checkpointer(tmp_path / "one", ["model", "optimizer"]).save(3, single, {})
    states.append(_snapshot(single))
    expected.append(single.step(batches[3]))
    states.append(_snapshot(single))

    dist = _distributed(tiny_model, _learner(tiny_model, *SETTINGS))
    try:
        assert all(isinstance(p, DTensor) for p in dist.local.model.parameters())
        for groups, m_single in zip(batches[:3], expected, strict=False):
            m_dist = dist.step(groups)
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
                assert m_dist[key] == pytest.approx(m_single[key], abs=1e-5), key
        adapter, merged = states[0]
        _close(dist.adapter_for_sync(), adapter)
        _close(dist.weights_for_sync(), merged)
        sharded = Checkpointer(tmp_path / "two", ["model", "optimizer"]).save(3, dist, {})
    finally:
        dist.close()

    def untied(model) -> list:  # the sync leaves out a tied head (the embedding's parameter)
        return [(k, v) for k, v in model.state_dict().items() if k not in lora.tied_copies(model)]

    exported = AutoModelForCausalLM.from_pretrained(sharded / "hf", dtype=torch.float32)
    _close(untied(exported), merged)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, sharded / "hf" / "adapter")
    _close(untied(peft.merge_and_unload()), merged)

    resumed = _learner(tiny_model, *SETTINGS)  # 2 ranks -> 1 process
    Checkpointer.open(sharded).apply(resumed, {"model", "optimizer"})
    step = resumed.step(batches[3])
    assert step["actor/pg_loss"] == pytest.approx(expected[3]["actor/pg_loss"], abs=1e-5)
    _close(resumed.adapter_for_sync(), states[1][0])

    again = _distributed(tiny_model, _learner(tiny_model, *SETTINGS))  # 1 process -> 2 ranks
    try:
        Checkpointer.open(one_proc).apply(again, {"model", "optimizer"})
        step = again.step(batches[3])
        assert step["actor/pg_loss"] == pytest.approx(expected[3]["actor/pg_loss"], abs=1e-5)
        _close(again.adapter_for_sync(), states[1][0])
        _close(again.weights_for_sync(), states[1][1])
    finally:
        again.close()

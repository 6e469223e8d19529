"""The torch learner's weights leave it under the checkpoint's names: transformers 5 holds a
Qwen3-MoE layer's experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I]); `weights_for_sync` (weight sync, the HF export) splits them into the
`mlp.experts.<e>.{gate,up,down}_proj.weight` tensors the model directory holds, the names
every engine (SGLang's MoE loader, the hf engine) loads at start."""

from __future__ import annotations

import torch
from safetensors import safe_open

from asyncrl.config import load_config
from asyncrl.learner.torch.learner import TorchLearner
from tests.moe_fixtures import random_moe


def saved_tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def test_weights_for_sync_are_the_checkpoints_tensors_under_its_names(tmp_path):
    random_moe(tmp_path, seed=3)
    cfg = load_config(None, [f"actor_train.model_args.model_name_or_path={tmp_path}",
                             "actor_train.model_args.dtype=fp32"])  # fmt: skip
    learner = TorchLearner(tmp_path, cfg.actor_train, cfg.actor, cfg.algorithm,
                           temperature=1.0, total_steps=1, device="cpu")  # fmt: skip
    sent = {n: t.detach().clone() for n, t in learner.weights_for_sync()}
    on_disk = saved_tensors(tmp_path)
    tied = {"lm_head.weight"} - set(on_disk)  # a tied head is not saved twice
    assert set(sent) - tied == set(on_disk)
    assert any(".mlp.experts.7.down_proj.weight" in n for n in sent)
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in sent)
    for name, tensor in on_disk.items():
        assert torch.equal(sent[name].to(tensor.dtype), tensor), name

"""The learner's policy read without transformers' modeling code (`learner/torch/lean_policy.py`):
its forward, gradients, learner steps and HF export are transformers' own; it is taken only
where its forward serves every path the learner runs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_decoder import _llama
from test_shared_prompt import _groups, _learner, _tensors, assert_same_steps
from transformers import AutoModelForCausalLM

from asyncrl.config import load_config
from asyncrl.learner import logprobs as lp
from asyncrl.learner.torch import lean_policy
from asyncrl.learner.torch.lean_policy import LeanCausalLM


def _pair(path) -> tuple[torch.nn.Module, torch.nn.Module]:
    lean = lean_policy.lean_policy(path, torch.float32)
    assert isinstance(lean, LeanCausalLM)
    return lean.train(), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()


@pytest.fixture(params=["qwen2", "llama"])
def model_dir(request, tiny_model, tmp_path):
    if request.param == "qwen2":
        return tiny_model
    _llama().save_pretrained(tmp_path)  # untied head, biases on every projection
    return tmp_path


def test_its_forward_and_gradients_equal_transformers(model_dir):
    """The padded batch the learner collates (left-padded prompts, right-padded responses):
    every real position's logits and final hidden states, the learner's response logits and
    every parameter's gradient through them."""
    lean, hf = _pair(model_dir)
    data = _tensors()
    data["input_ids"] = data["input_ids"] % hf.config.vocab_size
    real = data["attention_mask"].bool()
    kw = {k: data[k] for k in ("input_ids", "attention_mask", "position_ids")}
    a = lean(**kw, output_hidden_states=True)
    b = hf(**kw, output_hidden_states=True, use_cache=False)
    torch.testing.assert_close(a.logits[real], b.logits[real])
    torch.testing.assert_close(a.hidden_states[-1][real], b.hidden_states[-1][real])
    ends = real[:, -1]  # rows whose last position is real: logits_to_keep=1 reads it
    kept = lean(**kw, logits_to_keep=1).logits
    torch.testing.assert_close(kept[ends], b.logits[ends, -1:])
    mask = data["response_mask"].bool()
    grads = []
    for model in (lean, hf):
        logits = lp.response_logits(model, data)
        logits = logits.logits() if hasattr(logits, "logits") else logits
        loss = logits[mask].logsumexp(-1).sum()
        grads.append(dict(zip(
            [n for n, _ in model.named_parameters()],
            torch.autograd.grad(loss, list(model.parameters())), strict=True,
        )))  # fmt: skip
    assert grads[0].keys() == grads[1].keys()  # transformers' names, the tied head once
    for name, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_learner_takes_it_only_where_its_forward_serves(tiny_model):
    assert isinstance(_learner(tiny_model).model, LeanCausalLM)  # the CPU default's settings
    refused = {
        "actor.use_dynamic_bsz=true": "packed forwards",
        "actor.use_torch_compile=true": "torch.compile",
        "actor_train.model_args.lora_rank=4": "LoRA",
        "actor_train.model_args.disable_gradient_checkpointing=false": "activation",
        "actor_train.model_args.attn_implementation=eager": "attention implementation",
    }
    for override, why in refused.items():
        cfg = load_config(None, [override])
        args = cfg.actor_train.model_args
        assert why in lean_policy.why_not(args, cfg.actor, "cpu", 1), override
    cfg = load_config(None, [])
    args = cfg.actor_train.model_args
    assert lean_policy.why_not(args, cfg.actor, "cpu", 1) is None
    assert lean_policy.why_not(args, cfg.actor, "cuda", 1) == "an accelerator"
    assert lean_policy.why_not(args, cfg.actor, "cpu", 2) == "several ranks"
    packed = _learner(tiny_model, "actor.use_dynamic_bsz=true")
    assert type(packed.model).__name__ == "Qwen2ForCausalLM"  # transformers' own


def test_its_forward_refuses_what_it_does_not_compute(tiny_model):
    lean = lean_policy.lean_policy(tiny_model, torch.float32)
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(TypeError, match="unsupported arguments.*cu_seq_lens_q"):
        lean(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 4]))


def test_a_learner_step_on_it_equals_the_step_on_transformers_model(tiny_model, monkeypatch):
    lean_learner = _learner(tiny_model)
    monkeypatch.setattr(lean_policy, "why_not", lambda *args: "transformers' model asked for")
    hf_learner = _learner(tiny_model)
    assert isinstance(lean_learner.model, LeanCausalLM)
    assert not isinstance(hf_learner.model, LeanCausalLM)
    assert_same_steps(lean_learner, hf_learner)


def test_its_export_is_what_transformers_model_exports(tiny_model, tmp_path, monkeypatch):
    lean_learner = _learner(tiny_model)
    lean_learner.step(_groups(0))
    lean_learner.save_pretrained(tmp_path / "lean")
    monkeypatch.setattr(lean_policy, "why_not", lambda *args: "transformers' model asked for")
    hf_learner = _learner(tiny_model)
    hf_learner.save_pretrained(tmp_path / "hf")
    lean_dir, hf_dir = tmp_path / "lean", tmp_path / "hf"
    assert sorted(p.name for p in lean_dir.iterdir()) == sorted(p.name for p in hf_dir.iterdir())
    config = json.loads((lean_dir / "config.json").read_text())
    assert config == json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    lean_tensors, hf_tensors = (load_file(d / "model.safetensors") for d in (lean_dir, hf_dir))
    assert lean_tensors.keys() == hf_tensors.keys()  # a tied head left out by both
    back = AutoModelForCausalLM.from_pretrained(lean_dir, dtype=torch.float32)
    for (name, p), (_, q) in zip(back.named_parameters(), lean_learner.model.named_parameters(),
                                 strict=True):  # fmt: skip
        torch.testing.assert_close(p, q, msg=name)


def test_a_model_with_dropout_keeps_transformers_model(tmp_path):
    """transformers applies attention dropout inline in training; this forward does not."""
    _llama(attention_dropout=0.1).save_pretrained(tmp_path)
    assert lean_policy.lean_policy(tmp_path, torch.float32) is None

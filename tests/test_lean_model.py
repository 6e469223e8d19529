"""The hf engine's model read straight from its files (`engine/hf/lean_model.py`): the same
parameters under the same names as transformers' model, the same logits through the engine's
lanes (prefill and decode), weight updates loaded in place, transformers' modeling code never
imported by the engine process for it; models it does not build are left to transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import random_qwen2
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from asyncrl.engine.hf.batch import Seq
from asyncrl.engine.hf.lanes import Lane
from asyncrl.engine.hf.lean_model import CausalLM, lean_model


def _llama_dir(path, **extra):
    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
        attention_bias=True, tie_word_embeddings=False, **extra,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    for p in model.parameters():  # biases are zero at init: make them count
        p.data.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(params=["tiny", "qwen2", "llama"])
def model_dir(request, tiny_model, tmp_path):
    """The embedded model's architecture (tied head, character vocabulary), a Qwen2 with an
    untied head, a Llama with attention biases."""
    if request.param == "tiny":
        return tiny_model
    if request.param == "qwen2":
        random_qwen2(tmp_path / "q", init_std=0.2)
        return tmp_path / "q"
    return _llama_dir(tmp_path / "l")


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_parameters_as_transformers(model_dir, dtype):
    lean = lean_model(model_dir, dtype)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    assert isinstance(lean, CausalLM)
    got, want = _params(lean), _params(ref)
    assert list(got) == list(want)  # names and order: the learner's updates name these
    for name, p in want.items():
        assert got[name].dtype == p.dtype and torch.equal(got[name], p), name
    tied = ref.config.tie_word_embeddings
    assert (lean.lm_head.weight is lean.model.embed_tokens.weight) == tied
    assert lean.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(lean.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)


def _seqs(prompts):
    return [Seq(rid=str(i), prompt=p, params=None, on_done=None) for i, p in enumerate(prompts)]


def _generate(lane: Lane) -> list[torch.Tensor]:
    """Prefill (left padding) and 5 greedy decode steps: every step's logits."""
    with torch.inference_mode():
        batch, logits = lane.prefill(_seqs([[5, 6, 7], [8, 9], [10, 11, 12, 13]]))
        lane.batch, out = batch, [logits]
        for _ in range(5):
            lane.batch.last = out[-1].argmax(-1)
            out.append(lane.decode())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_equal_transformers_forward(model_dir, dtype):
    lean = Lane(lean_model(model_dir, dtype), "v")
    reference = Lane(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval(), "v")
    reference._lean = None  # transformers' own forward
    assert lean._lean is not None
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 0}
    for got, want in zip(_generate(lean), _generate(reference), strict=True):
        torch.testing.assert_close(got, want, **tol)


def test_an_update_loaded_in_place_is_served(tiny_model):
    """The weight receiver copies into the parameters the lanes read: the new weights are
    served at once, as by transformers' model given the same update."""
    lean = lean_model(tiny_model, torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p, q in zip(_params(lean).values(), _params(ref).values(), strict=True):
            new = torch.randn_like(p) * 0.1
            p.copy_(new)  # a tied head and its embedding: one tensor, updated once
            q.copy_(new)
    reference = Lane(ref, "v")
    reference._lean = None
    for got, want in zip(_generate(Lane(lean, "v")), _generate(reference), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes",
    [
        {"hidden_act": "gelu"},
        {"use_sliding_window": True},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
        {"quantization_config": {"quant_method": "gptq"}},
    ],
)
def test_what_it_does_not_build_is_left_to_transformers(tmp_path, changes):
    path = tmp_path / "m"
    random_qwen2(path)
    _edit_config(path, **changes)
    assert lean_model(path, torch.float32) is None


def test_renamed_weights_are_left_to_transformers(tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "m"
    random_qwen2(path)
    state = load_file(path / "model.safetensors")
    state["extra.weight"] = torch.zeros(2)
    save_file(state, path / "model.safetensors")
    assert lean_model(path, torch.float32) is None


def test_the_engine_process_never_imports_transformers_for_it(tiny_model):
    """A fresh process loads the engine as `python -m asyncrl.engine.hf.server` does: neither
    transformers nor torch's compiler stack (which its modeling code pulls in) is imported."""
    code = (
        "import sys\n"
        "from asyncrl.engine.hf import server\n"
        f"args = server.parse_args(['--model-path', {str(tiny_model)!r}, '--port', '1'])\n"
        "engine = server.load_engine(args)\n"
        "print(type(engine.model).__name__)\n"
        "print(sorted({m.split('.')[0] + '.' + m.split('.')[1] if m.startswith('torch.')"
        " else m.split('.')[0] for m in sys.modules if m.startswith(('transformers', "
        "'torch._dynamo', 'scipy'))}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["CausalLM", "[]"], out.stdout + out.stderr

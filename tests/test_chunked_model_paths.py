"""Every learner logprob path projects the LM head in chunks (`asyncrl.learner.chunked`) and
equals the whole-logits arithmetic it replaced (the model's logits over every position, the
response slice cast to fp32, / T, log softmax, entropy): the padded forward, each group's prompt
once, the packed forward, a LoRA policy (peft) and its adapter-off reference, with values and
gradients of every trained parameter under a loss that reads the entropy too."""

from __future__ import annotations

import pytest
import torch
from helpers import random_qwen2
from test_shared_prompt import _tensors

from asyncrl.config.schema import ModelArgs
from asyncrl.learner import chunked, lora
from asyncrl.learner import logprobs as lp


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    """Chunks of 5 tokens at the tests' 64-token vocabulary: many chunks per micro-batch."""
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 5 * 4 * 64)


def _whole_logits(model, data, temperature, with_entropy):
    """The replaced path: every position's logits, the response slice in fp32."""
    resp = data["response_mask"].shape[1]
    prompt = data["input_ids"].shape[1] - resp
    out = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"],
                position_ids=data["position_ids"], use_cache=False)  # fmt: skip
    logits = out.logits[:, prompt - 1 : prompt - 1 + resp].float()
    logits = logits / temperature if temperature > 0 else logits
    return lp._score(logits, data["input_ids"][:, -resp:], with_entropy)


def _loss_and_grads(model, fn, data):
    logp, ent = fn()
    mask = data["response_mask"]
    loss = (logp * data["advantages"] * mask).sum() - 0.3 * (ent * mask).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    return logp.detach(), ent.detach(), torch.autograd.grad(loss, params, allow_unused=True)


def _assert_same(model, data, got_fn, temperature=0.7):
    mask = data["response_mask"].bool()
    want = _loss_and_grads(model, lambda: _whole_logits(model, data, temperature, True), data)
    got = _loss_and_grads(model, got_fn, data)
    torch.testing.assert_close(got[0][mask], want[0][mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1][mask], want[1][mask], atol=1e-5, rtol=1e-5)
    for a, b in zip(got[2], want[2], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def _model():
    return random_qwen2(init_std=0.2).train()


@pytest.mark.parametrize("temperature", [0.7, 0.0])
@pytest.mark.parametrize("logits_fn", [None, lp.shared_prompt_logits])
def test_padded_and_shared_prompt_paths_equal_whole_logits(temperature, logits_fn):
    model, data = _model(), _tensors()
    fn = lambda: lp.token_logprobs(model, data, temperature, True, logits_fn=logits_fn)  # noqa: E731
    _assert_same(model, data, fn, temperature)


def test_packed_path_equals_whole_logits():
    model, data = _model(), _tensors()
    _assert_same(model, data, lambda: lp.token_logprobs(model, data, 0.7, True, packed=True))


def test_no_forward_computes_every_positions_logits():
    """The forward returns one position's logits; the rest are never computed."""
    model, data = _model(), _tensors()
    widths = []
    model.lm_head.register_forward_hook(lambda m, i, o: widths.append(o.shape[-2]))
    lp.token_logprobs(model, data, 1.0, True)
    lp.token_logprobs(model, data, 1.0, True, logits_fn=lp.shared_prompt_logits)
    lp.token_logprobs(model, data, 1.0, True, packed=True)
    assert widths == [1, 1, 1, 1]


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]])
def test_lora_policy_and_its_adapter_off_reference(targets):
    """peft's head is read through the base model; an adapted head (lm_head targeted) is not a
    plain linear layer: the policy then computes its own logits, the adapter-off reference
    projects the base layer (the adapter is off) in chunks."""
    torch.manual_seed(0)
    policy = lora.wrap(_model(), ModelArgs(lora_rank=4, target_modules=targets))
    for _, layer in lora.lora_layers(policy):  # B = 0 at start: make the adapter count
        torch.nn.init.normal_(layer.lora_B[lora.ADAPTER].weight, std=0.1)
    data = _tensors()
    adapted = "lm_head" in targets
    assert (chunked.output_head(policy) is None) == adapted
    _assert_same(policy, data, lambda: lp.token_logprobs(policy, data, 0.7, True))
    reference = lora.AdapterOff(policy)
    assert type(chunked.output_head(reference)) is torch.nn.Linear
    with torch.no_grad():
        got = lp.token_logprobs(reference, data, 0.7)[0]
        with policy.disable_adapter():
            want = _whole_logits(policy, data, 0.7, False)[0]
    mask = data["response_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)


def test_batched_and_budget_logprobs_equal_whole_logits():
    """The no-grad passes (old and reference logprobs) go through the same scoring."""
    model, data = _model().eval(), _tensors()
    mask = data["response_mask"].bool()
    with torch.no_grad():
        want = _whole_logits(model, data, 0.7, False)[0]
        for got in (lp.batched_logprobs(model, data, 0.7, 3), lp.budget_logprobs(model, data, 0.7, 40),
                    lp.batched_logprobs(model, data, 0.7, 3, pack_budget=32)):  # fmt: skip
            torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)


def test_only_plain_heads_are_projected_in_chunks():
    """Another model type keeps the model's own logits; a head that does more than project
    (here a hook doubling them: a soft-cap or scale) is refused, never scored wrongly."""
    model, data = _model(), _tensors()
    model.config.model_type = "gemma2"  # soft-caps its logits in the model's forward
    assert chunked.output_head(model) is None
    widths = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: widths.append(o.shape[-2]))
    lp.token_logprobs(model, data, 1.0)
    assert widths == [data["input_ids"].shape[1]]
    hook.remove()
    model.config.model_type = "qwen2"
    model.lm_head.register_forward_hook(lambda m, i, o: o * 2)
    with pytest.raises(RuntimeError, match="not its LM head applied"):
        lp.token_logprobs(model, data, 1.0)

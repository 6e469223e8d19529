"""The shared-prompt rule (`learner/prompt_rule.py`): its cost model's choices on synthetic
shapes, and the learner's logprobs and gradients whichever path it takes (equal to running
every row whole)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.learner import lean
from asyncrl.learner import logprobs as lp
from asyncrl.learner import prompt_rule as pr
from asyncrl.learner.collate import collate
from asyncrl.types import TrajectoryGroup

#: The embedded-size model of `asyncrl bench train` (hidden 128, MLP 384, 4 layers, 4 heads).
EMBEDDED = pr.Costs(token=2.0 * 4 * (4 * 128 * 128 + 3 * 128 * 384), pair=4.0 * 4 * 128)
HF_PATHS = [pr.SHARED, pr.WHOLE]
LEAN_PATHS = [pr.SHARED, pr.SHARED_CAUSAL, pr.WHOLE]


def _shape(prompt: int, response: int, n: int = 8, groups: int = 1, padded: bool = False):
    return pr.Shape(n * groups, groups, prompt, response, padded, prompt_padded=False)


def _choice(shape: pr.Shape, paths: list[str]) -> str:
    return pr.cheapest(paths, pr.path_costs(EMBEDDED, shape, paths))


@pytest.mark.parametrize(
    ("prompt", "response", "hf", "lean_path"),
    [
        (32, 1024, pr.WHOLE, pr.SHARED_CAUSAL),  # responses dominate: masked attention loses
        (256, 256, pr.SHARED, pr.SHARED),
        (1024, 64, pr.SHARED, pr.SHARED),  # the prompt dominates
        (64, 512, pr.WHOLE, pr.SHARED_CAUSAL),
    ],
)
def test_the_rule_shares_the_prompt_where_the_model_says_it_pays(prompt, response, hf, lean_path):
    assert _choice(_shape(prompt, response), HF_PATHS) == hf
    assert _choice(_shape(prompt, response), LEAN_PATHS) == lean_path


def test_padding_and_group_size_move_the_choice():
    # with padding the whole forward's attention is masked too: sharing pays again
    assert _choice(_shape(32, 1024, padded=True), HF_PATHS) == pr.SHARED
    # one response per prompt: nothing to share, the whole forward's causal kernel wins
    assert _choice(_shape(256, 256, n=1), HF_PATHS) == pr.WHOLE
    # with two or more rows per prompt the lean forward's best shared layout never costs more
    # than every row whole (with one it runs the prompt's attention twice)
    for p, r, n in [(16, 4096, 2), (4096, 16, 2), (512, 512, 16), (1, 1, 2)]:
        costs = pr.path_costs(EMBEDDED, _shape(p, r, n), LEAN_PATHS)
        assert min(costs[:2]) <= costs[2]


def test_model_costs_count_the_decoder_layers_and_attention(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    cfg = model.config
    costs = pr.model_costs(model)
    assert costs.token == 2 * sum(p.numel() for p in model.model.layers.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert costs.pair == 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim


def _batch(prompts: list[int], response: int, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Groups of the given prompt lengths, n responses of `response` tokens each."""
    rng = np.random.default_rng(seed)
    groups = []
    for gi, plen in enumerate(prompts):
        total = n * response
        groups.append(TrajectoryGroup(
            group_id=f"g{gi}", prompt_ids=rng.integers(4, 60, plen),
            response_lengths=np.full(n, response, np.int32), response_ids=rng.integers(4, 60, total),
            rollout_logprobs=np.zeros(total, np.float32), loss_mask=np.ones(total, np.uint8),
            versions=np.zeros(total, np.int32), rewards=np.zeros(n, np.float32),
            finish_reasons=["length"] * n,
            advantages=np.repeat(rng.standard_normal(n).astype(np.float32), response),
        ))  # fmt: skip
    data = collate(groups).to_torch("cpu")
    data["response_mask"] = data["response_mask"].float()
    return data


def test_shape_of_reads_the_micro_batch():
    s = pr.shape_of(_batch([3, 5], 4, n=2))
    assert (s.rows, s.groups, s.prompt, s.response) == (4, 2, 5, 4)
    assert s.padded and s.prompt_padded  # the 3-token prompt is left-padded to 5
    s = pr.shape_of(_batch([5], 4, n=3))
    assert (s.rows, s.groups, s.padded, s.prompt_padded) == (3, 1, False, False)


def _grads(model, fn, data):
    model.zero_grad()
    resp = data["response_mask"].shape[1]
    logp, ent = lp.token_logprobs(model, data, 1.0, True, False, fn)
    ((logp - 0.1 * ent) * data["advantages"] * data["response_mask"]).sum().backward()
    return logp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()], resp


@pytest.mark.parametrize("use_lean", [True, False])
@pytest.mark.parametrize(
    ("prompts", "response", "want"),
    # long equal responses after a short prompt: whole (transformers' forward) or causal (lean)
    [([2], 48, (pr.SHARED_CAUSAL, pr.WHOLE)), ([40, 33], 2, (pr.SHARED, pr.SHARED))],
)
def test_the_rule_takes_its_path_with_the_whole_rows_values(
    tiny_model, caplog, use_lean, prompts, response, want
):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()
    paths = {pr.SHARED: lp.shared_prompt_logits, pr.WHOLE: lp.response_logits}
    if use_lean:
        fn = lean.lean_shared_logits_for(model)
        paths = {pr.SHARED: fn, pr.SHARED_CAUSAL: lambda m, t: fn(m, t, causal=True),
                 pr.WHOLE: lp.response_logits}  # fmt: skip
    rule = pr.SharedPromptRule(model, paths, agree=False)
    data = _batch(prompts, response, n=4)
    with caplog.at_level(logging.INFO, logger=pr.__name__):
        assert rule.choose(data) == want[0 if use_lean else 1]
        got, reference = _grads(model, rule, data), _grads(model, lp.response_logits, data)
        _grads(model, rule, data)
    assert sum("the training forward runs" in r.getMessage() for r in caplog.records) == 1
    torch.testing.assert_close(got[0], reference[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], reference[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[2], reference[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

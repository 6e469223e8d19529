"""Proximal logprobs from the training forward (one optimizer step per batch) and the
token-budget recompute: the same step as the separate no-grad pass, one forward fewer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.config import load_config
from asyncrl.config.rules import LOSS_AGG_MODES
from asyncrl.learner.collate import collate
from asyncrl.learner.logprobs import (
    batched_logprobs,
    budget_chunks,
    budget_logprobs,
    has_dropout,
)
from asyncrl.learner.objective import prox_from_training_forward
from asyncrl.learner.torch.learner import TorchLearner
from asyncrl.types import TrajectoryGroup


def _groups(n_groups=2, n=3, seed=0):
    """Uneven prompt and response lengths; rollout logprobs far enough from the model's that
    rollout IS clips some tokens."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        responses = []
        for i in range(n):
            length = int(rng.integers(1, 9))
            responses.append(
                {
                    "response_ids": rng.integers(5, 40, length),
                    "rollout_logprobs": -rng.random(length) * 12,
                    "versions": np.zeros(length),
                    "reward": float(i % 2),
                    "finish_reason": "stop",
                    "advantages": np.full(length, 1.0 if i % 2 else -1.0),
                }
            )
        prompt = rng.integers(5, 40, 2 + 3 * g)
        groups.append(TrajectoryGroup.from_responses(f"g{seed}-{g}", prompt, responses))
    return groups


def _learner(model_dir, *overrides):
    cfg = load_config(
        None,
        [
            "actor_train.training_args.learning_rate=1e-3",
            "actor_train.training_args.per_device_train_batch_size=2",
            # rows run whole, as the recompute does: one forward per micro-batch, and the two
            # steps agree to 1e-6 (the shared-prompt path agrees to ~1e-6 only: test_shared_prompt)
            "actor.share_prompt_forward=false",
            *overrides,
        ],
    )
    return TorchLearner(
        model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, temperature=0.7, total_steps=10,
        reference=cfg.reference,
    )  # fmt: skip


def _count_forwards(learner: TorchLearner) -> list[int]:
    """Observes (does not change) the model's forward passes."""
    calls = [0]
    learner.model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _assert_same_step(model_dir, *overrides):
    """A step with the prox from the training forward equals one with the separate pass: loss,
    grad norm, every actor/ and mismatch/ metric and the weights after it, within 1e-6."""
    reuse, recompute = _learner(model_dir, *overrides), _learner(model_dir, *overrides)
    # A stochastic forward is the one thing that rules reuse out without changing the step.
    recompute.stochastic_forward = True
    f_reuse, f_recompute = _count_forwards(reuse), _count_forwards(recompute)
    ma, mb = reuse.step(_groups()), recompute.step(_groups())
    # 6 rows, micro-batches of 2: 3 training forwards; the recompute adds its own pass.
    assert f_reuse[0] == 3 and f_recompute[0] > 3
    for name, pa in reuse.model.named_parameters():
        pb = dict(recompute.model.named_parameters())[name]
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0, msg=name)
    keys = [k for k in mb if k.startswith(("actor/", "mismatch/"))]
    assert "actor/pg_loss" in keys and "actor/grad_norm" in keys
    assert sorted(k for k in ma if k.startswith(("actor/", "mismatch/"))) == sorted(keys)
    for key in keys:
        assert ma[key] == pytest.approx(mb[key], abs=1e-6, rel=1e-6), key
    return ma


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("rollout_is", [True, False])
def test_reused_prox_step_equals_the_recompute_step(tiny_model, agg, rollout_is):
    over = [f"actor.loss_agg_mode={agg}", f"algorithm.rollout_is={str(rollout_is).lower()}"]
    metrics = _assert_same_step(tiny_model, *over)
    assert "mismatch/mismatch_kl" in metrics  # IS metrics whether or not the weights apply


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor.policy_loss.loss_mode=decoupled"],
        ["algorithm.rollout_is_level=sequence", "algorithm.rollout_is_mode=clip"],
        ["algorithm.rollout_is_level=geometric", "algorithm.rollout_is_veto_threshold=0.05"],
        ["actor.use_kl_loss=true", "actor.entropy_coeff=0.01"],
    ],
)
def test_reused_prox_step_equals_the_recompute_step_for_other_objectives(tiny_model, overrides):
    _assert_same_step(tiny_model, *overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor.ppo_epochs=2"],
        ["actor.ppo_mini_batch_size=4"],
        ["algorithm.rollout_rs=[{name: token_k3, upper: 5.0}]"],
        ["algorithm.rollout_is_batch_normalize=true"],
        ["algorithm.correction_mode=bypass"],
        # ROLL's global batch: 2 per device × 1 accumulation × 1 rank, 3 steps over 6 rows
        ["actor_train.training_args.per_device_train_batch_size=2",
         "actor_train.training_args.gradient_accumulation_steps=1"],
    ],
)  # fmt: skip
def test_prox_is_recomputed_when_the_training_forward_is_not_the_proximal_policy(overrides):
    from asyncrl.config.plan import step_size

    cfg = load_config(None, overrides)
    size = step_size(cfg.actor, cfg.actor_train.training_args, 1)  # the learner's, one rank
    assert not prox_from_training_forward(cfg.algorithm, cfg.actor, 6, False, size)
    default = load_config(None, [])
    assert prox_from_training_forward(default.algorithm, default.actor, 6, False, None)
    assert not prox_from_training_forward(default.algorithm, default.actor, 6, True, None)


def test_several_mini_batches_still_recompute_the_prox(tiny_model):
    learner = _learner(tiny_model, "actor.ppo_mini_batch_size=4")
    forwards = _count_forwards(learner)
    metrics = learner.step(_groups())
    # 2 mini-batches (4 + 2 rows) of micro-batches of 2: 3 training forwards, plus the recompute
    assert forwards[0] > 3
    assert "mismatch/mismatch_kl" in metrics


def test_budget_logprobs_equal_fixed_count_batches_under_the_mask(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    data = collate(_groups(n_groups=3), 0).to_torch()
    width = data["input_ids"].shape[1]
    mask = data["response_mask"].bool()
    fixed = batched_logprobs(model, data, 0.7, 4)
    for budget in (1, width, 4 * width, 10_000):
        got = budget_logprobs(model, data, 0.7, budget)
        torch.testing.assert_close(got[mask], fixed[mask], atol=1e-5, rtol=1e-5)


def test_budget_chunks_pack_short_rows_within_the_budget():
    # [left-padded prompt of 4 | right-padded response of 8] per row
    prompt_len, spans = 4, [(1, 1), (4, 5), (2, 1), (1, 1), (4, 8), (3, 1)]
    attention = torch.zeros(len(spans), 12, dtype=torch.long)
    for row, (p, r) in enumerate(spans):
        attention[row, prompt_len - p : prompt_len + r] = 1
    chunks = budget_chunks(attention, prompt_len, token_budget=12)
    assert sorted(int(r) for c in chunks for r in c) == list(range(len(spans)))
    for chunk in chunks:
        width = max(spans[r][0] for r in chunk) + max(spans[r][1] for r in chunk)
        assert len(chunk) * width <= 12 or len(chunk) == 1  # a row over the budget goes alone
    # rows 0, 3 (2 tokens) and 2 (3 tokens) share one forward of 3 × 3; row 5 (3 + 1) would
    # widen it to 4 × 4 > 12, so it starts the next chunk
    assert [0, 2, 3] in [sorted(c.tolist()) for c in chunks]


def test_dropout_rules_reuse_out(tiny_model):
    assert not has_dropout(AutoModelForCausalLM.from_pretrained(tiny_model))
    assert has_dropout(AutoModelForCausalLM.from_pretrained(tiny_model, attention_dropout=0.1))

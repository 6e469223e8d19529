"""The plain-PyTorch learner on a tiny random model: logprob layout, accumulation, updates."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from asyncrl.config import load_config
from asyncrl.learner.collate import collate
from asyncrl.learner.logprobs import token_logprobs
from asyncrl.learner.torch.learner import TorchLearner
from asyncrl.types import TrajectoryGroup


@pytest.fixture
def model_dir(tiny_model):
    return tiny_model


def _groups(n_groups=2, n=3, seed=0, version=0):
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        responses = []
        for i in range(n):
            length = int(rng.integers(1, 6))
            responses.append(
                {
                    "response_ids": rng.integers(5, 40, length),
                    "rollout_logprobs": -rng.random(length) * 3,
                    "versions": np.full(length, version),
                    "reward": float(i % 2),
                    "finish_reason": "stop",
                    "advantages": np.full(length, 1.0 if i % 2 else -1.0),
                }
            )
        groups.append(
            TrajectoryGroup.from_responses(f"g{seed}-{g}", rng.integers(5, 40, 2 + g), responses)
        )
    return groups


def _learner(model_dir, *overrides):
    cfg = load_config(
        None,
        [
            "actor_train.training_args.learning_rate=1e-3",
            "actor_train.model_args.disable_gradient_checkpointing=true",
            *overrides,
        ],
    )
    return TorchLearner(
        model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, temperature=0.7, total_steps=10,
        reference=cfg.reference,
    )  # fmt: skip


def test_logprobs_match_manual_per_sequence_forward(model_dir):
    learner = _learner(model_dir)
    groups = _groups()
    data = collate(groups, learner.pad_id).to_torch()
    logp, _ = token_logprobs(learner.model, data, temperature=0.7)
    row = 0
    for g in groups:
        for i in range(g.n):
            ids = torch.tensor(np.concatenate([g.prompt_ids, g.response(i)]))[None].long()
            with torch.no_grad():
                logits = learner.model(input_ids=ids).logits[0].float() / 0.7
            p = len(g.prompt_ids)
            ref = torch.log_softmax(logits[p - 1 : -1], -1).gather(-1, ids[0, p:, None])[:, 0]
            got = logp[row, : len(ref)].detach()
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            row += 1


def test_micro_batch_accumulation_equals_one_big_batch(model_dir):
    a = _learner(model_dir, "actor_train.training_args.per_device_train_batch_size=1")
    b = _learner(model_dir, "actor_train.training_args.per_device_train_batch_size=6")
    groups = _groups()
    ma, mb = a.step(groups), b.step(groups)
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5, msg=name)
    # The reported metrics are the mini-batch's too, however the rows were split.
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/clipfrac", "actor/grad_norm"):
        assert ma[key] == pytest.approx(mb[key], rel=1e-5, abs=1e-7), key


def test_step_updates_version_and_raises_advantaged_logprobs(model_dir):
    learner = _learner(model_dir, "algorithm.correction_mode=bypass", "actor.ppo_epochs=4")
    groups = _groups()
    data = collate(groups, learner.pad_id).to_torch()
    before, _ = token_logprobs(learner.model, data, 0.7)
    metrics = learner.step(groups)
    after, _ = token_logprobs(learner.model, data, 0.7)
    assert learner.version == 1
    mask = data["response_mask"].bool()
    delta = (after - before).detach()[mask]
    adv = data["advantages"][mask]
    assert (delta[adv > 0].mean() > 0) and (delta[adv < 0].mean() < 0)
    assert all(np.isfinite(v) for v in metrics.values())
    assert "mismatch/mismatch_kl" in metrics and "actor/pg_loss" in metrics


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor.policy_loss.loss_mode=decoupled"],
        ["actor.policy_loss.loss_mode=gspo", "actor.loss_agg_mode=seq-mean-token-mean"],
        ["actor.use_kl_loss=true", "actor.entropy_coeff=0.01"],
        ["algorithm.rollout_is_level=sequence", "algorithm.rollout_is_mode=clip"],
        [
            "algorithm.rollout_rs=[{name: token_k3, upper: 5.0}]",
            "algorithm.rollout_is_batch_normalize=true",
        ],
        ["actor.ppo_mini_batch_size=2", "actor.shuffle=true", "actor.ppo_epochs=2"],
    ],
)
def test_step_variants_are_finite(model_dir, overrides):
    learner = _learner(model_dir, *overrides)
    metrics = learner.step(_groups())
    assert learner.version == 1
    assert all(np.isfinite(v) for v in metrics.values()), metrics


def test_state_dict_round_trip(model_dir):
    a = _learner(model_dir)
    a.step(_groups())
    b = _learner(model_dir)
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # as if through torch.save/load
    assert b.version == 1
    a.step(_groups(seed=1))
    b.step(_groups(seed=1))
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        torch.testing.assert_close(pa, pb, msg=name)


def test_weights_for_sync_are_hf_names(model_dir):
    learner = _learner(model_dir)
    names = [n for n, _ in learner.weights_for_sync()]
    assert "model.embed_tokens.weight" in names
    assert any(n.startswith("model.layers.0.self_attn") for n in names)

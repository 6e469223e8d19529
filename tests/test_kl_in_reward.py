"""KL-in-reward (verl's `algorithm.use_kl_in_reward`, `kl_ctrl`): the math against closed forms,
the torch learner's token rewards against a hand-built batch, and the coefficient's checkpoint.

The reference is a tiny model with the actor's tokenizer and other weights, so the KL is far
from 0; nothing is faked.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algo.advantages import batch_token_advantages
from asyncrl.algo.group_advantages import AdvantageParams
from asyncrl.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    make_kl_controller,
)
from asyncrl.config import ConfigError, load_config
from asyncrl.learner.torch.learner import TorchLearner
from tests.test_critic import _data
from tests.test_reference_worker import build_reference_model
from tests.test_torch_learner import _groups

D = torch.float64
RFPP = "reinforce_plus_plus"


# ------------------------------------------------------------------ the math


def test_apply_kl_penalty_closed_form():
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]], dtype=D)
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]], dtype=D)
    ref = torch.tensor([[-1.5, -1.0, -9.0], [-1.0, -0.25, -0.5]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=D)
    rewards, current = apply_kl_penalty(scores, old, ref, mask, beta=0.1, kl_type="kl")
    # kl = old - ref on valid tokens: row 0 [0.5, -1.0, (masked)], row 1 [0.5, -0.25, 0.0]
    want = [[-0.05, 1.1, 0.0], [-0.05, 0.025, 2.0]]
    assert rewards.tolist() == [pytest.approx(r) for r in want]
    assert current == pytest.approx(((0.5 - 1.0) / 2 + (0.5 - 0.25 + 0.0) / 3) / 2)
    k3 = apply_kl_penalty(scores, old, ref, mask, 1.0, "low_var_kl")[0]
    assert float(k3[0, 0]) == pytest.approx(-(math.exp(-0.5) + 0.5 - 1))


def test_adaptive_controller_is_verls():
    ctrl = AdaptiveKLController(0.2, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.11, n_steps=10)  # error 0.1 → beta · (1 + 0.1 · 10/100)
    assert ctrl.value == pytest.approx(0.2 * 1.01)
    ctrl.update(current_kl=1.0, n_steps=10)  # error clipped to +0.2
    assert ctrl.value == pytest.approx(0.2 * 1.01 * 1.02)
    ctrl.update(current_kl=0.0, n_steps=50)  # clipped to -0.2
    assert ctrl.value == pytest.approx(0.2 * 1.01 * 1.02 * 0.9)
    fixed = make_kl_controller("fixed", 0.3)
    fixed.update(5.0, 1000)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.3
    restored = make_kl_controller("adaptive", 0.2, 0.1, 100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value
    with pytest.raises(ValueError, match="fixed, adaptive"):
        make_kl_controller("pid", 0.1)


# ------------------------------------------------------------------ in the torch learner


@pytest.fixture(scope="module")
def reference_dir(tiny_model, tmp_path_factory):
    return build_reference_model(tiny_model, tmp_path_factory.mktemp("kl-reference"))


def _learner(model_dir, reference_dir, *overrides: str) -> TorchLearner:
    cfg = load_config(
        None,
        [
            f"algorithm.adv_estimator={RFPP}",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.kl_coef=0.5",
            f"reference.model_args.model_name_or_path={reference_dir}",
            "actor_train.model_args.disable_gradient_checkpointing=true",
            *overrides,
        ],
    )
    return TorchLearner(
        model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, temperature=0.7, total_steps=10,
        reference=cfg.reference,
    )  # fmt: skip


def test_token_rewards_carry_the_penalty_before_the_estimator(tiny_model, reference_dir):
    learner = _learner(tiny_model, reference_dir, "algorithm.gamma=0.9")
    data = _data(_groups())
    prep, _ = learner._prepare(data)
    metrics = learner._advantages(data, prep)
    mask = data["response_mask"].double()
    kl = (prep["old"] - prep["ref_all"]).double() * mask
    assert float(kl.abs().max()) > 0.05  # the reference differs: the penalty is not a no-op
    scores = torch.zeros_like(mask)
    last = (mask.sum(-1) - 1).long()  # single-turn rows: the outcome on the last token
    scores[torch.arange(len(last)), last] = data["rewards"].double()
    want, _ = batch_token_advantages(
        RFPP, scores - 0.5 * kl, mask, data["group_index"], AdvantageParams(gamma=0.9)
    )
    torch.testing.assert_close(data["advantages"].double(), want, rtol=1e-4, atol=1e-5)
    per_row = kl.sum(-1) / mask.sum(-1)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(float(per_row.mean()), rel=1e-5)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5


def test_kl_in_reward_alone_adds_no_kl_loss_and_trains(tiny_model, reference_dir):
    learner = _learner(tiny_model, reference_dir)
    metrics = learner.step(_groups())
    assert "actor/kl_loss" not in metrics and "actor/reward_kl_penalty" in metrics
    both = _learner(tiny_model, reference_dir, "actor.use_kl_loss=true").step(_groups())
    assert "actor/kl_loss" in both


def test_the_adaptive_coefficient_moves_and_is_checkpointed(tiny_model, reference_dir):
    adaptive = ("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=6")
    a = _learner(tiny_model, reference_dir, *adaptive)
    first = a.step(_groups())["actor/reward_kl_penalty_coeff"]
    assert first == 0.5 and a.kl_ctrl.value != 0.5
    b = _learner(tiny_model, reference_dir, *adaptive)
    b.load_state_dict(a.state_dict())
    assert b.kl_ctrl.value == a.kl_ctrl.value
    assert a.step(_groups(seed=1))["actor/reward_kl_penalty_coeff"] == b.kl_ctrl.value


# ------------------------------------------------------------------ what is refused


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["algorithm.use_kl_in_reward=true"], "computed in the rollout workers"),
        ([f"algorithm.adv_estimator={RFPP}", "algorithm.use_kl_in_reward=true",
          "actor_train.strategy_args.strategy_name=megatron_train"], "megatron_train"),
        (["algorithm.kl_penalty=full"], "algorithm.kl_penalty"),
        (["algorithm.kl_ctrl.type=pid"], "algorithm.kl_ctrl.type"),
        (["algorithm.kl_ctrl.target_kl=0"], "algorithm.kl_ctrl.target_kl"),
        (["algorithm.kl_ctrl.horizon=0"], "algorithm.kl_ctrl.horizon"),
        (["algorithm.kl_ctrl.kl_coef=-1"], "algorithm.kl_ctrl.kl_coef"),
    ],
)  # fmt: skip
def test_validation_refuses_what_kl_in_reward_cannot_honour(overrides, words):
    with pytest.raises(ConfigError, match=words) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)


def test_a_reference_section_is_read_by_kl_in_reward_alone(reference_dir):
    cfg = load_config(None, [f"algorithm.adv_estimator={RFPP}", "algorithm.use_kl_in_reward=true",
                             f"reference.model_args.model_name_or_path={reference_dir}"])  # fmt: skip
    assert cfg.reference is not None and not cfg.actor.use_kl_loss

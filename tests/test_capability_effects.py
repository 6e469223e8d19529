"""Every enumerated algorithm value changes what the learner computes.

The capability matrix runs each value through the real loop, but a run that ignores a key still
trains with a finite loss. Here each value of an algorithm field (read from the schema through
`tests/capability.py`, so a new value is covered the day it is added) is set in a config with
`load_config`, and the run's own pieces consume it: the rollout worker's group builder scores a
fixed set of completions (its group advantages), the run's learner factory builds the learner,
and one learner step trains on that batch. Every value of a field must give a different loss or
update from every other value of the field, except the names documented as one estimator.

The batch is built so the values differ: rewards with variance within and between groups,
responses of different lengths, rollout logprobs far from the policy's (importance weights
outside the truncation bounds), a reference model of its own (a KL that is not zero), two PPO
epochs (the second sees ratios away from 1, where the clipped losses part) and SGD (an update
proportional to the gradient, where Adam's first step would keep only its signs).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asyncrl.config import ConfigError, load_config
from tests import capability as cap

FIELDS = (
    "algorithm.adv_estimator",
    "actor.policy_loss.loss_mode",
    "actor.loss_agg_mode",
    "actor.kl_loss_type",
    "algorithm.kl_penalty",
    "algorithm.rollout_is_level",
    "algorithm.rollout_is_mode",
    "algorithm.correction_mode",
    "algorithm.kl_ctrl.type",
)
# The adaptive KL controller moves its coefficient after a step: the second step shows it.
STEPS = {"algorithm.kl_ctrl.type": 2}
# Names of one estimator (`asyncrl/algo/kl.py`'s docstring): they must agree, not differ.
KL_ALIASES = ({"kl", "k1"}, {"mse", "k2"}, {"low_var_kl", "k3"})
SAME = {"actor.kl_loss_type": KL_ALIASES, "algorithm.kl_penalty": KL_ALIASES}
# Two prompts of 3 responses, lengths 1..8 (token ids of printable characters): the rewards
# (`length_reward`) vary within each group and their means differ between the groups.
RESPONSES = (((40, 41), (42,) * 5, (43, 44, 45)), ((46,) * 8, (47,), (48, 49, 50, 51)))
PROMPT = (30, 31, 32, 33)
BASE = [
    "max_steps=4",  # a schedule longer than the step: the learning rate stays at its peak
    "rollout_batch_size=2",
    "num_return_sequences_in_group=3",
    "response_length=8",
    "actor.ppo_epochs=2",
    "actor.optim.name=sgd",
    "actor_train.training_args.learning_rate=0.5",
    "actor_train.model_args.disable_gradient_checkpointing=true",
    "actor.kl_loss_coef=0.5",
    "algorithm.kl_ctrl.kl_coef=0.5",
    "algorithm.lam=0.9",  # gae parts from REINFORCE++ (a zero-init value head: lam=1 is equal)
    "rollout.reward_fn=tests.test_capability_effects:length_reward",
]


def length_reward(prompt: str, response: str, metadata: Mapping[str, Any]) -> float:
    """The response's length in characters, over 4: graded, different per response."""
    return len(response) / 4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    from asyncrl.models.tiny import TinyModelSpec, build_model, build_tokenizer

    tok = build_tokenizer()
    out = {}
    for seed, name in enumerate(("policy", "other")):  # two inits: the reference differs
        spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4)
        path = tmp_path_factory.mktemp(f"effects-{name}")
        build_model(dataclasses.replace(spec, seed=seed), tok).save_pretrained(path)
        tok.save_pretrained(path)
        out[name] = str(path)
    return out


def overrides(path: str, value: Any, models: dict[str, str]) -> list[str]:
    """The config that sets `path` to `value`, with what the value needs around it
    (`capability.requirements`: a critic for gae, the KL switches for the KL types)."""
    out = [*BASE, f"actor_train.model_args.model_name_or_path={models['policy']}"]
    needs = cap.requirements(path, value) | {path: value}
    if path in ("actor.kl_loss_type", "algorithm.kl_penalty"):  # a reference of its own
        needs["reference"] = cap.ON
    for key, want in needs.items():
        want = want[0] if isinstance(want, cap.AnyOf) else want
        if key in ("critic", "reference"):
            if want == cap.ON:
                model = models["policy" if key == "critic" else "other"]
                out.append(f"{key}.model_args.model_name_or_path={model}")
        else:
            out.append(f"{key}={want}")
    return out


def fixed_groups(cfg: Any, model_dir: str) -> list[Any]:
    """The batch, built by the rollout worker's group builder from fixed completions: it
    scores them with the config's reward and computes the config's group advantages."""
    from asyncrl.data.prompts import PromptItem
    from asyncrl.engine.replies import Completion
    from asyncrl.rollout.single_turn import GroupBuilder
    from asyncrl.startup import rollout_settings

    builder = GroupBuilder(rollout_settings(cfg, Path(model_dir), ["http://127.0.0.1:9"]))
    gen = np.random.default_rng(0)
    groups = []
    for g, responses in enumerate(RESPONSES):
        completions = [
            Completion(
                output_ids=list(ids),
                # far from the tiny policy's (about -4.6): weights beyond both IS bounds
                output_logprobs=gen.uniform(-7.5, -2.0, len(ids)).tolist(),
                finish_reason="stop",
                weight_version="0",
                prompt_tokens=len(PROMPT),
            )
            for ids in responses
        ]
        item = PromptItem(key=f"g{g}", prompt_ids=list(PROMPT), prompt_text="abcd")
        groups.append(builder._build_group(item, completions))
    return groups


def fingerprint(path: str, value: Any, models: dict[str, str]) -> dict[str, Any] | None:
    """What one learner step on the fixed batch gives with `path` = `value`: its metrics and
    the parameters after it. None: `config validate` refuses the value (the matrix checks that
    refusal names the reason)."""
    from asyncrl.run import build_learner

    try:
        cfg = load_config(None, overrides(path, value, models))
    except ConfigError:
        return None
    groups = fixed_groups(cfg, models["policy"])
    learner = build_learner(cfg, Path(models["policy"]))
    try:
        torch.manual_seed(0)
        for _ in range(STEPS.get(path, 1)):
            metrics = learner.step(groups)
        params = torch.cat([p.detach().flatten().double() for p in learner.model.parameters()])
    finally:
        learner.close()
    return {"metrics": metrics, "params": params}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The two steps computed the same loss and the same update."""
    if not torch.allclose(a["params"], b["params"], rtol=1e-9, atol=1e-12):
        return False
    keys = ("actor/pg_loss", "actor/kl_loss", "actor/reward_kl_penalty", "learner/adv_mean")
    for key in keys:
        x, y = a["metrics"].get(key), b["metrics"].get(key)
        if (x is None) != (y is None) or x is not None and abs(x - y) > 1e-9 * max(1, abs(x)):
            return False
    return True


def _values(path: str) -> tuple[Any, ...]:
    return next(d.values for d in cap.dimensions() if d.path == path)


@pytest.mark.parametrize("path", FIELDS)
def test_every_value_changes_the_step(models, path):
    runs = {v: fingerprint(path, v, models) for v in _values(path)}
    taken = {v: r for v, r in runs.items() if r is not None}
    assert len(taken) >= 2, f"{path}: fewer than two values validate: {sorted(runs)}"
    for run in taken.values():  # the value trained: the weights moved
        assert torch.isfinite(run["params"]).all()
    aliases = SAME.get(path, ())
    for (a, ra), (b, rb) in itertools.combinations(taken.items(), 2):
        alias = any({a, b} <= group for group in aliases)
        assert _same(ra, rb) == alias, (
            f"{path}: {a} and {b} " + ("differ" if alias else "give the same step")
            + f": {_summary(ra)} vs {_summary(rb)}"
        )  # fmt: skip


def _summary(run: dict[str, Any]) -> str:
    keys = ("actor/pg_loss", "actor/kl_loss", "actor/reward_kl_penalty", "learner/adv_mean")
    shown = {k: run["metrics"][k] for k in keys if k in run["metrics"]}
    return f"{shown} |params|={float(run['params'].norm()):.9g}"


def test_fixed_batch_has_what_the_values_need(models):
    """The batch's own properties the comparisons rely on."""
    cfg = load_config(None, overrides("algorithm.adv_estimator", "grpo", models))
    groups = fixed_groups(cfg, models["policy"])
    rewards = [np.asarray(g.rewards) for g in groups]
    assert all(r.std() > 0 for r in rewards) and rewards[0].mean() != rewards[1].mean()
    assert len({int(n) for g in groups for n in g.response_lengths}) > 3

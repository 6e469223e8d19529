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
        if key == "env" and want == cap.OFF:
            continue  # single-turn: the default
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
    groups = 2 * fixed_groups(cfg, models["policy"])
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


# -- the replay side: the staleness bound and the token budget --------------------------------
STALENESS = ("async.max_staleness", "async.max_inflight_tokens")
LONG_PROMPT = list(range(30, 94))  # prompt_length (64) tokens: each prompt a worst case


@pytest.fixture(scope="module")
def stale_learner_metrics(models) -> list[dict[str, Any]]:
    """Three steps of the run's learner on the fixed batch taken twice (12 rows: the sequence
    ratios' ESS, auto's default signal, counts a lag from 8): sampled at its version (lag 0),
    then one version behind it, twice (lag 1; rollout logprobs far from the policy's, so the
    ESS is well below 1)."""
    from asyncrl.run import build_learner

    cfg = load_config(None, overrides("async.max_staleness", "auto", models))
    groups = 2 * fixed_groups(cfg, models["policy"])
    learner = build_learner(cfg, Path(models["policy"]))

    def sampled_at(version: int) -> list[Any]:
        return [dataclasses.replace(g, versions=np.full_like(g.versions, version)) for g in groups]

    try:
        torch.manual_seed(0)
        return [learner.step(sampled_at(max(0, learner.version - 1))) for _ in range(3)]
    finally:
        learner.close()


def admission_fingerprint(cfg: Any, learner_metrics: list[dict[str, Any]]) -> tuple:
    """What the run's replay queue (`run.make_queue`) does with `cfg`: prompts admitted at the
    start, the bound after the learner's three steps, prompts admitted after that."""
    from asyncrl.run import make_queue

    q = make_queue(cfg)
    keys = (f"p{i}" for i in itertools.count())

    def admit() -> int:
        n = 0
        while (k := q.capacity()) > 0:  # as the dispatcher does: each prompt charged its own
            batch = [next(keys) for _ in range(k)]
            n += q.reserve(k, batch, [{"key": b, "prompt_ids": LONG_PROMPT} for b in batch])
        return n

    first = admit()
    for metrics in learner_metrics:
        q.observe(metrics)
    return first, q.bound, admit()


def test_staleness_and_token_budget_values_change_admission(models, stale_learner_metrics):
    """Every value of `async.max_staleness` (0, 1, 2, auto) and of `async.max_inflight_tokens`
    (off, on) makes the run's queue admit differently; auto moves its bound from the learner's
    own `is/seq_ess_by_lag` metrics (1 -> 0 here: lag 1's ESS misses the target twice)."""
    assert any("is/seq_ess_by_lag/1" in m for m in stale_learner_metrics)
    seen = {}
    for dim in (d for d in cap.dimensions() if d.path in STALENESS):
        for value in dim.values:
            extra = ["async.target_ess=0.99"] if value == "auto" else []
            cfg = load_config(None, [*overrides(dim.path, value, models), *extra])
            seen[(dim.path, value)] = admission_fingerprint(cfg, stale_learner_metrics)
    assert seen[("async.max_staleness", 0)] == (2, 0, 0)  # one batch per version
    assert seen[("async.max_staleness", 1)] == (4, 1, 0)
    assert seen[("async.max_staleness", 2)] == (6, 2, 0)
    assert seen[("async.max_staleness", "auto")] == (4, 0, 0)  # started at 1, tightened to 0
    # one batch at its worst case (2 x 3 x (64 + 8)) holds 2 such prompts, not the bound's 4
    assert seen[("async.max_inflight_tokens", cap.TOKEN_BUDGET)] == (2, 1, 0)
    for path in STALENESS:
        values = [v for (p, v) in seen if p == path]
        for a, b in itertools.combinations(values, 2):
            assert seen[(path, a)] != seen[(path, b)], (path, a, b, seen)


def test_a_kl_target_tightens_auto_where_the_ess_target_does_not(models, stale_learner_metrics):
    """`async.target_kl` is read from the learner's own `is/kl_by_lag` metrics: with an ESS
    target no lag misses, the bound stays at its start without a KL target and drops to 0
    with one the lag-1 rows' KL exceeds."""
    assert all(m.get("is/kl_by_lag/1", 0) > 1e-6 for m in stale_learner_metrics[1:])
    auto = [*overrides("async.max_staleness", "auto", models), "async.target_ess=0.01"]
    ess_only = admission_fingerprint(load_config(None, auto), stale_learner_metrics)
    with_kl = load_config(None, [*auto, "async.target_kl=1e-6"])
    assert ess_only == (4, 1, 0)  # started at 1, kept (3 healthy steps < the 4 a relax needs)
    assert admission_fingerprint(with_kl, stale_learner_metrics) == (4, 0, 0)

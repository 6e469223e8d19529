"""The critic worker (value model, `critic:` section) of the torch learner, and GAE with it.

verl's clipped value loss and explained variance against closed forms; the value head's slice
against one unpadded forward per sequence; GAE in the learner against a hand-written recursion
over the critic's own values; warm-up, the value loss falling on a fixed batch, checkpoints
(save → load → identical next steps) and the validation rules. The models are the tiny random
ones from conftest; nothing else is faked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.checkpoint import Checkpointer
from asyncrl.config import ConfigError, load_config
from asyncrl.learner.collate import collate
from asyncrl.learner.critic import (
    CriticConfigError,
    ValueModel,
    critic_model_path,
    value_loss,
    value_metrics,
)
from asyncrl.learner.torch.learner import TorchLearner
from tests.helpers import random_qwen2
from tests.test_torch_learner import _groups

D = torch.float64
GAE = ("algorithm.adv_estimator=gae", "critic={}")
# The critic learner these tests train (tests/test_distributed_learner.py and test_fsdp2.py too)
CRITIC = (
    *GAE,
    "actor_train.training_args.learning_rate=1e-3",
    "actor_train.model_args.disable_gradient_checkpointing=true",
    "critic.model_args.disable_gradient_checkpointing=true",
    "critic.training_args.learning_rate=3e-3",
)


def _learner(model_dir, *overrides: str) -> TorchLearner:
    cfg = load_config(None, [*CRITIC, *overrides])
    return TorchLearner(
        model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, temperature=0.7, total_steps=10,
        reference=cfg.reference, critic=cfg.critic,
    )  # fmt: skip


def _data(groups, pad_id: int = 0) -> dict[str, torch.Tensor]:
    data = collate(sorted(groups, key=lambda g: g.group_id), pad_id).to_torch()
    data["response_mask"] = data["response_mask"].float()
    return data


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------ the math, closed forms


def test_value_loss_is_verls_clipped_loss():
    vpreds = torch.tensor([[1.0, 0.2, -0.4]], dtype=D)
    values = torch.tensor([[0.0, 0.0, 0.0]], dtype=D)
    returns = torch.tensor([[2.0, -1.0, 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=D)
    loss, clipfrac = value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    # token 0: clipped to 0.5: max((1-2)², (0.5-2)²) = 2.25 (clipped wins);
    # token 1: inside the range: max((0.2+1)², same) = 1.44; token 2 masked out.
    assert float(loss) == pytest.approx(0.5 * (2.25 + 1.44) / 2)
    assert float(clipfrac) == pytest.approx(0.5)
    seq = value_loss(vpreds, returns, values, mask, 0.5, "seq-mean-token-sum")[0]
    assert float(seq) == pytest.approx(0.5 * (2.25 + 1.44))


def test_a_prediction_inside_the_clip_range_is_never_counted_as_clipped():
    """Inside the range the clipped prediction is the prediction itself, bit for bit: computed
    as `values + clamp(vpreds - values)` it is off by an ulp for about a quarter of the pairs
    that straddle zero (the two-rank critic test's one flipped token), and the clip fraction
    counted rounding. verl clamps the prediction itself."""
    g = torch.Generator().manual_seed(0)
    values = torch.rand(1, 4000, generator=g) * 0.1 - 0.05  # float32, as the critic's values
    vpreds = torch.rand(1, 4000, generator=g) * 0.1  # every |vpreds - values| < 0.15
    returns = torch.randn(1, 4000, generator=g)
    assert bool(((values + (vpreds - values)) != vpreds).any())  # the rounding is there
    loss, clipfrac = value_loss(vpreds, returns, values, torch.ones(1, 4000), cliprange_value=0.5)
    assert float(clipfrac) == 0.0
    assert float(loss) == pytest.approx(0.5 * float((vpreds - returns).square().mean()))


def test_value_loss_of_micro_batches_sums_to_the_mini_batch_loss():
    g = torch.Generator().manual_seed(0)
    vpreds, values, returns = (torch.randn(4, 5, generator=g, dtype=D) for _ in range(3))
    mask = (torch.rand(4, 5, generator=g) > 0.3).to(D)
    whole = value_loss(vpreds, returns, values, mask, 0.2)[0]
    parts = sum(
        value_loss(vpreds[i : i + 2], returns[i : i + 2], values[i : i + 2], mask[i : i + 2],
                   0.2, num_tokens=mask.sum())[0]
        for i in (0, 2)
    )  # fmt: skip
    torch.testing.assert_close(parts, whole)


def test_explained_variance_closed_form():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=D)
    perfect = value_metrics(returns.clone(), returns, mask)
    assert perfect["critic/vf_explained_var"] == pytest.approx(1.0, abs=1e-4)
    mean = value_metrics(torch.full_like(returns, 2.0), returns, mask)
    assert mean["critic/vf_explained_var"] == pytest.approx(0.0, abs=1e-4)
    assert mean["critic/values_mean"] == pytest.approx(2.0)
    # V = 0: Var(G - V) = Var(G), explained 0; V = G/2: Var(G/2) = Var(G)/4, explained 3/4
    half = value_metrics(returns / 2, returns, mask)["critic/vf_explained_var"]
    assert half == pytest.approx(0.75, abs=1e-4)


# ------------------------------------------------------------------ the value model


def test_values_read_the_state_before_each_response_token(tiny_model):
    from transformers import AutoModel

    torch.manual_seed(0)
    model = ValueModel(AutoModel.from_pretrained(tiny_model), 32)
    with torch.no_grad():
        assert float(model(_data(_groups())).abs().max()) == 0.0  # zero head: V = 0 at start
    torch.nn.init.normal_(model.value_head.weight)
    groups = _groups()
    data = _data(groups)
    with torch.no_grad():
        got = model(data)
    row = 0
    for g in sorted(groups, key=lambda g: g.group_id):
        for i in range(g.n):
            ids = torch.tensor(np.concatenate([g.prompt_ids, g.response(i)]))[None].long()
            with torch.no_grad():
                hidden = model.trunk(input_ids=ids).last_hidden_state[0]
            p, r = len(g.prompt_ids), len(g.response(i))
            want = model.value_head(hidden[p - 1 : p - 1 + r]).squeeze(-1)
            torch.testing.assert_close(got[row, :r], want, atol=1e-5, rtol=1e-4)
            row += 1


def test_critic_model_defaults_to_the_actors_and_must_share_its_vocabulary(tiny_model, tmp_path):
    assert critic_model_path("", tiny_model) == tiny_model
    other = tmp_path / "vocab64"
    random_qwen2(other)  # a 64-token vocabulary; the embedded tokenizer has more
    with pytest.raises(CriticConfigError, match="vocab_size 64") as err:
        critic_model_path(str(other), tiny_model)
    assert "\n" not in str(err.value)
    with pytest.raises(CriticConfigError, match="not a Hugging Face model directory"):
        _learner(tiny_model, f"critic.model_args.model_name_or_path={tmp_path / 'nowhere'}")


# ------------------------------------------------------------------ GAE in the learner


def _gae_by_hand(rewards, values, mask, gamma, lam):
    """verl's recursion over each row's valid tokens, then whitened over the batch."""
    adv = np.zeros_like(values)
    for b in range(values.shape[0]):
        valid = np.flatnonzero(mask[b])
        last, next_v = 0.0, 0.0
        for t in valid[::-1]:
            r = rewards[b] if t == valid[-1] else 0.0  # the outcome on the last valid token
            delta = r + gamma * next_v - values[b, t]
            last = delta + gamma * lam * last
            adv[b, t], next_v = last, values[b, t]
    flat = adv[mask > 0]
    return (adv - flat.mean()) / np.sqrt(flat.var(ddof=1) + 1e-8) * mask


def test_gae_uses_the_critics_fresh_values(tiny_model):
    learner = _learner(tiny_model, "algorithm.gamma=0.9", "algorithm.lam=0.8")
    learner.step(_groups(seed=3))  # the critic has trained once: its values are not all 0
    data = _data(_groups(seed=4))
    values = learner.critic.values(data).double().numpy()
    mask = data["response_mask"].numpy()
    assert np.abs(values[mask > 0]).min() > 0
    prep, _ = learner._prepare(data)
    metrics = learner._advantages(data, prep)
    want = _gae_by_hand(data["rewards"].numpy(), values, mask, 0.9, 0.8)
    np.testing.assert_allclose(data["advantages"].numpy(), want, rtol=1e-4, atol=1e-5)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var",
                "critic/values_mean"):  # fmt: skip
        assert np.isfinite(metrics[key]), key


def test_value_loss_falls_on_a_fixed_batch(tiny_model):
    learner = _learner(tiny_model, "algorithm.critic_warmup=100")  # the actor stays put
    groups = _groups(seed=5)
    losses = [learner.step(groups)["critic/vf_loss"] for _ in range(6)]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.6 * losses[0], losses


def test_critic_warmup_trains_the_critic_only(tiny_model):
    learner = _learner(tiny_model, "algorithm.critic_warmup=2")
    actor, critic = _params(learner.model), _params(learner.critic.model)
    for step in (1, 2):
        metrics = learner.step(_groups(seed=step))
        assert learner.version == step  # admission opens per version, warm-up or not
        assert "actor/pg_loss" not in metrics and "critic/vf_loss" in metrics
    assert _same(actor, _params(learner.model))
    assert not _same(critic, _params(learner.critic.model))
    assert "actor/pg_loss" in learner.step(_groups(seed=3))
    assert not _same(actor, _params(learner.model))


@pytest.mark.parametrize("contents", [["model", "optimizer"], ["model"]])
def test_checkpoint_saves_and_resumes_the_critic(tiny_model, tmp_path, contents):
    a = _learner(tiny_model)
    a.step(_groups(seed=1))
    path = Checkpointer(tmp_path, contents).save(1, a, {})
    state = torch.load(path / "learner.pt", weights_only=True)
    assert ("optimizer" in state["critic"]) == ("optimizer" in contents)
    b = _learner(tiny_model)
    Checkpointer.open(path).apply(b, set(contents))
    assert b.version == 1 and b.critic.updates == 1
    assert _same(_params(a.critic.model), _params(b.critic.model))
    if "optimizer" not in contents:
        return
    a.step(_groups(seed=2))
    b.step(_groups(seed=2))
    for x, y in zip(_params(a.critic.model), _params(b.critic.model), strict=True):
        torch.testing.assert_close(x, y)
    for x, y in zip(_params(a.model), _params(b.model), strict=True):
        torch.testing.assert_close(x, y)


# ------------------------------------------------------------------ what is refused


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["algorithm.adv_estimator=gae"], "gae needs a critic section"),
        (["algorithm.critic_warmup=2"], "critic_warmup needs a critic section"),
        (["critic={}"], "reads no values"),
        ([*GAE, "critic.strategy_args.strategy_name=megatron_train"], "not available yet"),
        ([*GAE, "actor_train.strategy_args.strategy_name=megatron_train"], "not available yet"),
        ([*GAE, "critic.device_mapping=[1]"], "critic.device_mapping"),
        (
            [*GAE, "actor_train.device_mapping=[0,1]", "critic.device_mapping=[0]"],
            "critic.device_mapping",
        ),
        ([*GAE, "algorithm.cliprange_value=0"], "algorithm.cliprange_value"),
        ([*GAE, "algorithm.critic_warmup=-1"], "algorithm.critic_warmup"),
    ],
)
def test_validation_refuses_what_the_critic_cannot_honour(overrides, words):
    with pytest.raises(ConfigError, match=words) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)


def test_a_critic_with_a_data_parallel_actor_train_validates():
    """The critic shards over actor_train's devices like the actor (FSDP2): `config validate`
    and the learner's own check accept it (tests/test_distributed_learner.py runs it)."""
    from asyncrl.learner.objective import check_learner_side

    for mapping in ([], ["critic.device_mapping=[0,1]"]):
        cfg = load_config(None, [*GAE, "actor_train.device_mapping=[0,1]", *mapping])
        assert cfg.critic is not None and list(cfg.actor_train.device_mapping) == [0, 1]
        check_learner_side(cfg.algorithm, has_critic=True, world_size=2)


def test_a_critic_config_validates_and_the_learner_refuses_it_without_gae(tiny_model):
    cfg = load_config(None, [*GAE, "algorithm.critic_warmup=3", "algorithm.cliprange_value=0.2"])
    assert cfg.critic is not None and cfg.algorithm.critic_warmup == 3
    with pytest.raises(ValueError, match="reads no values"):
        TorchLearner(tiny_model, cfg.actor_train, cfg.actor, load_config(None, []).algorithm,
                     temperature=0.7, total_steps=1, critic=cfg.critic)  # fmt: skip

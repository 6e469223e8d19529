"""Each group's prompt run once (`actor.share_prompt_forward`): the same logprobs, gradients
and learner step as running every row whole, and the activation-checkpointing auto rule that
decides where it applies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.config import load_config
from asyncrl.config.schema import ModelArgs
from asyncrl.learner import logprobs as lp
from asyncrl.learner.chunked import Projection
from asyncrl.learner.collate import collate
from asyncrl.learner.torch.learner import TorchLearner
from asyncrl.types import TrajectoryGroup


def _groups(seed: int = 0) -> list[TrajectoryGroup]:
    """Groups of different prompt lengths (left padding in the batch), sizes and ragged
    response lengths: the layouts a micro-batch meets."""
    rng = np.random.default_rng(seed)
    out = []
    for gi, (plen, n) in enumerate(((5, 3), (9, 2), (3, 4))):
        lengths = rng.integers(1, 6, n).astype(np.int32)
        total = int(lengths.sum())
        out.append(TrajectoryGroup(
            group_id=f"g{gi}", prompt_ids=rng.integers(4, 60, plen),
            response_lengths=lengths, response_ids=rng.integers(4, 60, total),
            rollout_logprobs=-rng.exponential(1.0, total).astype(np.float32),
            loss_mask=np.ones(total, np.uint8), versions=np.zeros(total, np.int32),
            rewards=rng.random(n).astype(np.float32), finish_reasons=["length"] * n,
            advantages=np.repeat(rng.standard_normal(n).astype(np.float32), lengths),
        ))  # fmt: skip
    return out


def assert_same_steps(a, b, seeds=(0, 1)) -> dict:
    """Learners `a` and `b` take the same steps (the second on the weights the first produced):
    equal metrics and weights. Returns `a`'s last metrics."""
    for seed in seeds:
        ma, mb = a.step(_groups(seed)), b.step(_groups(seed))
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl"):
            assert ma[key] == pytest.approx(mb[key], rel=1e-4, abs=1e-7), key
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    return ma


def full(logits: lp.Logits) -> torch.Tensor:
    """The whole [..., V] fp32 logits of what a `LogitsFn` returns (a `Projection` or them)."""
    return logits.logits() if isinstance(logits, Projection) else logits


def _tensors(rows: slice | None = None) -> dict[str, torch.Tensor]:
    data = collate(_groups()).to_torch("cpu")
    data["response_mask"] = data["response_mask"].float()
    if rows is not None:  # a micro-batch that starts and ends inside a group
        data = {k: v[rows] for k, v in data.items()}
    return data


@pytest.mark.parametrize("rows", [None, slice(1, 7)])
def test_shared_prompt_logits_equal_running_every_row_whole(tiny_model, rows):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    data = _tensors(rows)
    mask = data["response_mask"].bool()
    model.eval()
    with torch.no_grad():
        whole = full(lp.response_logits(model, data))
        shared = full(lp.shared_prompt_logits(model, data))
    assert whole.shape == shared.shape
    torch.testing.assert_close(shared[mask], whole[mask], rtol=0, atol=1e-5)
    model.train()
    grads = []
    for fn in (lp.response_logits, lp.shared_prompt_logits):
        model.zero_grad()
        logp, _ = lp.score(fn(model, data), data["input_ids"][:, -mask.shape[1] :], 1.0, False)
        (logp * data["advantages"] * data["response_mask"]).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def _learner(tiny_model, *overrides: str) -> TorchLearner:
    cfg = load_config(None, ["actor_train.training_args.per_device_train_batch_size=4",
                             "actor_train.model_args.disable_gradient_checkpointing=true",
                             *overrides])  # fmt: skip
    torch.manual_seed(0)
    return TorchLearner(tiny_model, cfg.actor_train, cfg.actor, cfg.algorithm, 1.0, 10)


def test_a_learner_step_with_shared_prompts_equals_the_whole_rows_step(tiny_model):
    shared = _learner(tiny_model)
    whole = _learner(tiny_model, "actor.share_prompt_forward=false")
    assert shared.logits_fn is not None and whole.logits_fn is None
    shared.logits_fn.paths.pop("whole")  # the shared paths only (the rule's choice aside)
    for seed in (0, 1):  # two steps: the second on the weights the first produced
        a, b = shared.step(_groups(seed)), whole.step(_groups(seed))
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
    for p, q in zip(shared.model.parameters(), whole.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_shared_prompts_apply_only_where_layers_keep_the_cache(tiny_model):
    checkpointed = _learner(
        tiny_model, "actor_train.model_args.disable_gradient_checkpointing=false"
    )
    packed = _learner(tiny_model, "actor.use_dynamic_bsz=true")
    assert checkpointed.logits_fn is None and packed.logits_fn is None


def test_checkpointing_auto_is_off_only_for_the_embedded_actor():
    assert ModelArgs().actor_checkpointing() is False  # the embedded tiny model
    assert ModelArgs(model_name_or_path="/m").actor_checkpointing() is True  # ROLL's default
    assert ModelArgs(disable_gradient_checkpointing=False).actor_checkpointing() is True
    assert ModelArgs("/m", disable_gradient_checkpointing=True).actor_checkpointing() is False

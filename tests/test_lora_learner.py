"""LoRA in the torch learner (peft): the step, what trains, the reference, sync and checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.learner import lora
from asyncrl.learner.collate import collate
from asyncrl.learner.logprobs import token_logprobs
from asyncrl.learner.torch.learner import TorchLearner
from tests.test_torch_learner import _groups

LORA = [
    "actor_train.model_args.lora_rank=4",
    "actor_train.model_args.lora_alpha=8",
    "actor_train.model_args.disable_gradient_checkpointing=true",
    "actor_train.training_args.learning_rate=1e-2",
    "actor_train.training_args.per_device_train_batch_size=2",
]


def _learner(model_dir, *overrides: str) -> TorchLearner:
    cfg = load_config(None, [*LORA, *overrides])
    return TorchLearner(
        model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, temperature=0.7, total_steps=10,
        reference=cfg.reference,
    )  # fmt: skip


def _batch(learner: TorchLearner, seed: int = 0) -> dict[str, torch.Tensor]:
    data = collate(sorted(_groups(seed=seed), key=lambda g: g.group_id), learner.pad_id)
    data = data.to_torch("cpu")
    data["response_mask"] = data["response_mask"].float()
    return data


def _logprobs(model: torch.nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model, data, 0.7)[0] * data["response_mask"]


def _train_a_step(learner: TorchLearner, seed: int = 0) -> None:
    learner.step(_groups(seed=seed))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_only_adapter_params_train_and_have_optimizer_state(tiny_model, checkpointing):
    off = str(not checkpointing).lower()
    learner = _learner(tiny_model, f"actor_train.model_args.disable_gradient_checkpointing={off}")
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    trainable = {n for n, p in learner.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    opt_params = [p for g in learner.optimizer.param_groups for p in g["params"]]
    assert len(opt_params) == len(trainable)
    _train_a_step(learner)
    after = dict(learner.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed and changed <= trainable
    assert any(".lora_B." in n for n in changed)  # B starts at 0: a step must move it


def test_lora_step_equals_hand_done_peft_step(tiny_model):
    """One learner step (vanilla loss, bypass, one mini-batch) = the same loss built by hand on a
    fresh peft model, then AdamW: the adapter tensors agree."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    overrides = ["algorithm.correction_mode=bypass", "actor.loss_agg_mode=token-mean"]
    # rows run whole, as the hand-built loss below does (test_shared_prompt checks the other)
    learner = _learner(tiny_model, *overrides, "actor.share_prompt_forward=false")
    torch.manual_seed(0)  # the same fresh adapter as the learner's (seed 0 before wrapping)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    hand = get_peft_model(base, cfg)
    # lora_A is random at init: start the hand model from the learner's exact adapter
    lora.load_adapter_state(hand, lora.adapter_state(learner.model))
    data = _batch(learner)
    learner.step(_groups())
    params = [p for p in hand.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    hand.train()
    logp = token_logprobs(hand, data, 0.7)[0]
    mask = data["response_mask"]
    old = data["rollout_logprobs"]
    ratio = torch.exp(logp - old)
    adv = data["advantages"]
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss_tok = torch.maximum(-adv * ratio, -adv * clipped)
    loss = (loss_tok * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    got, want = lora.adapter_state(learner.model), lora.adapter_state(hand)
    assert got.keys() == want.keys()
    for key in got:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


def test_adapter_off_reference_is_the_base_model(tiny_model):
    from transformers import AutoModelForCausalLM

    learner = _learner(tiny_model, "actor.use_kl_loss=true")
    assert isinstance(learner.reference, lora.AdapterOff)
    assert not list(learner.reference.state_dict())  # no second copy of the base
    for seed in range(2):
        _train_a_step(learner, seed)
    data = _batch(learner, seed=5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    learner.model.eval()
    want = _logprobs(base, data)
    torch.testing.assert_close(_logprobs(learner.reference, data), want, rtol=0, atol=1e-6)
    # ... while the policy itself has moved away from the base
    assert (_logprobs(learner.model, data) - want).abs().max() > 1e-4


def test_weights_for_sync_are_merged_hf_tensors(tiny_model):
    from transformers import AutoModelForCausalLM

    learner = _learner(tiny_model)
    _train_a_step(learner)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    merged = dict(learner.weights_for_sync())
    # all but the tied head, which is the embedding's parameter (loaded with it)
    assert lora.tied_copies(base) == {"lm_head.weight"}
    assert set(merged) == set(base.state_dict()) - {"lm_head.weight"}
    base.load_state_dict(merged, strict=False)
    data = _batch(learner, seed=3)
    learner.model.eval()
    torch.testing.assert_close(_logprobs(base.eval(), data), _logprobs(learner.model, data),
                               rtol=0, atol=1e-5)  # fmt: skip
    adapter = dict(learner.adapter_for_sync())
    assert adapter and all(n.endswith((lora.LORA_A, lora.LORA_B)) for n in adapter)
    full_bytes = sum(t.numel() * t.element_size() for t in merged.values())
    assert sum(t.numel() * t.element_size() for t in adapter.values()) < full_bytes


def test_checkpoint_round_trip_resumes_the_adapter(tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from asyncrl.checkpoint import Checkpointer

    learner = _learner(tiny_model)
    _train_a_step(learner)
    saved = Checkpointer(tmp_path, ["model", "optimizer", "hf_model"]).save(1, learner, {})
    loaded = Checkpointer.open(saved)
    assert all(".lora_" in k for k in loaded.state["model"])  # the adapter only, not the base
    fresh = _learner(tiny_model)
    fresh.load_state_dict(loaded.state)
    assert fresh.version == learner.version
    for key, value in lora.adapter_state(learner.model).items():
        torch.testing.assert_close(lora.adapter_state(fresh.model)[key], value, rtol=0, atol=0)
    # resuming continues identically (optimizer moments restored too)
    _train_a_step(learner, seed=1)
    _train_a_step(fresh, seed=1)
    for key, value in lora.adapter_state(learner.model).items():
        torch.testing.assert_close(lora.adapter_state(fresh.model)[key], value, rtol=0, atol=0)
    # the HF export: merged weights, and the adapter in PEFT format
    data = _batch(fresh, seed=2)
    merged = AutoModelForCausalLM.from_pretrained(saved / "hf", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, saved / "hf" / "adapter").eval()
    torch.testing.assert_close(_logprobs(merged, data), _logprobs(peft, data), rtol=0, atol=1e-5)


def test_checkpoint_of_the_other_kind_is_refused(tiny_model):
    full = load_config(None, ["actor_train.model_args.disable_gradient_checkpointing=true"])
    plain = TorchLearner(tiny_model, full.actor_train, full.actor, full.algorithm, 0.7, 10)
    with pytest.raises(lora.LoraSetupError, match="has no LoRA adapter"):
        _learner(tiny_model).load_state_dict(copy.deepcopy(plain.state_dict()))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor_train.model_args.lora_rank=-1"], "lora_rank: -1 is negative"),
        (
            [
                "actor_train.model_args.lora_rank=8",
                "actor_train.strategy_args.strategy_name=megatron_train",
            ],
            "LoRA needs the fsdp2_train learner",
        ),  # fmt: skip
        (["actor_infer.model_args.lora_rank=8"], "actor_infer.model_args.lora_rank: LoRA is set"),
        (
            ["actor_train.model_args.lora_rank=8", "actor_train.model_args.lora_dropout=1.0"],
            "lora_dropout",
        ),  # fmt: skip
        (
            ["actor_train.model_args.lora_rank=8", "actor_train.model_args.target_modules=q_"],
            "neither all-linear",
        ),  # fmt: skip
        (
            [
                "actor_train.model_args.lora_rank=8",
                "weight_sync.lora_sync=adapter",
                "actor_infer.strategy_args.strategy_name=sglang",
            ],
            "adapter needs hf_infer",
        ),  # fmt: skip
    ],
)
def test_validation_refuses_lora_it_cannot_honour(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_unknown_target_module_is_one_line(tiny_model):
    with pytest.raises(lora.LoraSetupError, match="target_modules"):
        _learner(tiny_model, "actor_train.model_args.target_modules=[no_such_proj]")


def test_an_adapter_on_a_tied_head_is_refused(tiny_model):
    """The tiny model ties its head to the embedding: neither engine could serve it alone."""
    with pytest.raises(lora.LoraSetupError, match="lm_head is tied to the input embedding"):
        _learner(tiny_model, "actor_train.model_args.target_modules=[q_proj,lm_head]")

"""The step plan is what the learner does: a real `TorchLearner`, built as the run builds it
(`asyncrl.run.build_learner`, the schedule sized from the plan), trains a whole run of
rollouts; its real optimizer steps are counted (an optimizer step hook) and must equal the
plan's, and the learning-rate schedule must end at its end value on exactly the last step."""

from __future__ import annotations

import math

import pytest

from asyncrl.config import ConfigError, derive_plan, load_config
from asyncrl.config.plan import mini_batches, optimizer_steps, step_size
from asyncrl.config.schema import TrainingArgs
from asyncrl.run import build_learner
from tests.test_torch_learner import _groups

GROUPS, N, ROLLOUTS, LR, FLOOR = 4, 2, 2, 1e-3, 0.1
BASE = (
    f"rollout_batch_size={GROUPS}", f"num_return_sequences_in_group={N}",
    f"max_steps={ROLLOUTS}", f"actor_train.training_args.learning_rate={LR}",
    "actor_train.model_args.disable_gradient_checkpointing=true",
    "actor_train.training_args.lr_scheduler_type=cosine", f"actor.optim.min_lr_ratio={FLOOR}",
    "actor_train.training_args.per_device_train_batch_size=8", "algorithm.correction_mode=bypass",
)  # fmt: skip
MICRO = "actor_train.training_args.per_device_train_batch_size"
ACCUM = "actor_train.training_args.gradient_accumulation_steps"
CRITIC = ("algorithm.adv_estimator=gae", "critic={}", "algorithm.critic_warmup=1",
          "critic.model_args.disable_gradient_checkpointing=true",
          "critic.training_args.lr_scheduler_type=linear",
          "critic.training_args.per_device_train_batch_size=2")  # fmt: skip

# (overrides, optimizer steps per rollout): 8 sequences a rollout
GRID = [
    ((), 1),
    (("actor.ppo_mini_batch_size=4", "actor.ppo_epochs=2", "actor.shuffle=true"), 4),  # half
    (("actor.ppo_mini_batch_size=2",), 4),  # quarter
    (("actor.ppo_mini_batch_size=3",), 3),  # 3 + 3 + 2
    ((f"{MICRO}=3",), 1),  # micro-batches of 3, 3, 2: one step
    ((f"{MICRO}=2", f"{ACCUM}=1"), 4),  # ROLL: 2 × 1 × 1 rank = 2 sequences a step
    ((f"{MICRO}=2", f"{ACCUM}=2", "actor.ppo_mini_batch_size=4"), 2),  # both, agreeing
    (("actor.ppo_mini_batch_size=16",), 1),  # 16 > 8 sequences: one step over the rollout
    (
        (
            "actor.use_dynamic_bsz=true",
            "actor.ppo_max_token_len_per_gpu=16",
            "actor.ppo_mini_batch_size=4",
        ),
        2,
    ),
    (("actor_train.training_args.warmup_steps=2", "actor.ppo_mini_batch_size=4"), 2),
    ((*CRITIC, "actor.ppo_mini_batch_size=4"), 2),
]


@pytest.mark.parametrize(("overrides", "per_rollout"), GRID, ids=lambda v: str(v))
def test_the_learner_takes_the_planned_steps_and_ends_the_schedule(
    tiny_model, overrides, per_rollout
):
    cfg = load_config(None, [*BASE, *overrides])
    plan = derive_plan(cfg)
    assert plan.optimizer_steps_per_rollout == per_rollout
    learner = build_learner(cfg, tiny_model)
    used: list[float] = []  # the learning rate of every real optimizer step
    learner.optimizer.register_step_post_hook(
        lambda opt, *_: used.append(opt.param_groups[0]["lr"])
    )
    critic_steps: list[float] = []
    if learner.critic is not None:
        learner.critic.optimizer.register_step_post_hook(lambda opt, *_: critic_steps.append(1.0))
    reported = []
    for r in range(ROLLOUTS):
        before = len(used)
        reported.append(learner.step(_groups(GROUPS, N, seed=r, version=r))["learner/lr"])
        warm = r < plan.critic_warmup_rollouts
        assert len(used) - before == (0 if warm else plan.optimizer_steps_per_rollout)
    learner.close()
    assert len(used) == plan.actor_optimizer_steps == plan.schedule_horizon
    # the schedule ends on the run's last step, not before: every step trained above the
    # floor (the warm-up's first steps below the peak), the lr after the last step is it
    assert reported[-1] == pytest.approx(LR * FLOOR)
    assert all(lr > LR * FLOOR * (1 + 1e-6) for lr in used)
    if cfg.actor_train.training_args.warmup_steps == 2:
        assert used[:3] == pytest.approx([LR / 2, LR, LR])
    if learner.critic is not None:  # it trains every rollout, the warm-up ones too
        assert len(critic_steps) == ROLLOUTS * plan.critic_optimizer_steps_per_rollout
        end = cfg.critic.training_args.learning_rate * FLOOR  # actor.optim's floor
        assert learner.critic.scheduler.get_last_lr()[0] == pytest.approx(end)


def test_mini_batches_cover_every_row_once_in_steps():
    for rows in (1, 7, 8, 512):
        for size in (None, 1, 3, 8, 256, 1000):
            parts = mini_batches(rows, size)
            assert [i for p in parts for i in p] == list(range(rows))
            assert len(parts) == math.ceil(rows / min(size or rows, rows))
            assert optimizer_steps(rows, size, 2) == 2 * len(parts)


def test_gradient_accumulation_is_rolls_global_batch():
    """ROLL: global train batch = per_device × gradient_accumulation_steps × data-parallel
    ranks (Megatron: world / tp·pp·cp); one step per rollout at the derived accumulation."""
    cfg = load_config(None, ["rollout_batch_size=64", "num_return_sequences_in_group=8",
                             "actor_train.device_mapping=list(range(0,16))",
                             f"{MICRO}=2", f"{ACCUM}=4"])  # fmt: skip
    plan = derive_plan(cfg)
    assert plan.global_train_batch_size == 2 * 4 * 16
    assert plan.optimizer_steps_per_rollout == 512 // 128
    assert step_size(cfg.actor, cfg.actor_train.training_args, 16) == 128
    one = load_config(None, ["rollout_batch_size=64", "num_return_sequences_in_group=8",
                             "actor_train.device_mapping=list(range(0,16))", f"{MICRO}=2",
                             f"{ACCUM}={plan.derived_gradient_accumulation_steps}"])  # fmt: skip
    assert derive_plan(one).optimizer_steps_per_rollout == 1


def test_accumulation_and_mini_batch_that_disagree_are_refused(tiny_model):
    bad = [f"{MICRO}=2", f"{ACCUM}=2", "actor.ppo_mini_batch_size=8"]
    with pytest.raises(
        ConfigError,
        match=r"^actor_train.training_args.gradient_accumulation_st"
        r"eps: 2 × per_device_train_batch_size 2 × 1 data-par",
    ):
        load_config(None, [*BASE, *bad])
    cfg = load_config(None, [*BASE, "actor.ppo_mini_batch_size=8"])
    with pytest.raises(ValueError, match="they size the same step: set one"):
        step_size(cfg.actor, TrainingArgs(per_device_train_batch_size=2,
                                          gradient_accumulation_steps=2), 1)  # fmt: skip
    with pytest.raises(ConfigError, match=r"^critic.training_args.gradient_accumulation_steps"):
        load_config(None, [*BASE, *CRITIC, "actor.ppo_mini_batch_size=4",
                           "critic.training_args.gradient_accumulation_steps=1"])  # fmt: skip


def test_a_global_batch_beyond_the_rollout_is_refused():
    """ROLL's count of micro-batches cannot be honoured past the rollout's 8 sequences."""
    with pytest.raises(
        ConfigError,
        match=r"^actor_train.training_args.gradient_accumulation_"
        r"steps: 4 micro-batches .* 16 .* 8 .* at most 2 here",
    ):
        load_config(None, [*BASE, f"{MICRO}=4", f"{ACCUM}=4"])  # fmt: skip
    assert derive_plan(load_config(None, [*BASE, f"{MICRO}=4", f"{ACCUM}=2"])).warnings == []


def test_accumulation_with_dynamic_bsz_is_refused():
    with pytest.raises(ConfigError, match="packed by tokens.*set actor.ppo_mini_batch_size"):
        load_config(None, [*BASE, f"{ACCUM}=2", "actor.use_dynamic_bsz=true"])


# -- keys that validate must do something ----------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reference.strategy_args.strategy_name=megatron_infer"],
         r"^reference.strategy_args.strategy_name: megatron_infer is not what the fsdp2_train "
         r"learner runs \(the reference is a transformers model"),
        (["reference.strategy_args.strategy_name=hf_infer",
          "actor_train.strategy_args.strategy_name=megatron_train"],
         r"^reference.strategy_args.strategy_name: hf_infer is not what the megatron_train"),
        (["actor_infer.infer_batch_size=8"], r"^actor_infer.infer_batch_size: not read for"),
        (["actor_train.num_gpus_per_worker=2"], r"^actor_train.num_gpus_per_worker: not read"),
        (["reference.num_gpus_per_worker=2"], r"^reference.num_gpus_per_worker: not read"),
    ],
)  # fmt: skip
def test_keys_no_worker_reads_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["actor.use_kl_loss=true", "reference={}", *overrides])


def test_reference_names_of_the_learners_backend_validate():
    for learner, name in (("fsdp2_train", "hf_infer"), ("fsdp2_train", "fsdp2_train"),
                          ("megatron_train", "megatron_infer")):  # fmt: skip
        cfg = load_config(None, ["actor.use_kl_loss=true", "reference={}",
                                 f"actor_train.strategy_args.strategy_name={learner}",
                                 f"reference.strategy_args.strategy_name={name}"])  # fmt: skip
        assert cfg.reference.strategy_args.strategy_name == name


# -- a resumed run's schedules ---------------------------------------------------------------
def test_a_resume_onto_another_step_plan_is_refused_where_the_schedule_decays():
    from asyncrl.config.plan import check_resumed_plan, schedule_record

    saved = schedule_record(derive_plan(load_config(None, list(BASE))))
    assert saved["optimizer_steps_per_rollout"] == 1
    check_resumed_plan(saved, load_config(None, list(BASE)))  # the same plan
    check_resumed_plan(None, load_config(None, [*BASE, "actor.ppo_epochs=2"]))  # older save
    with pytest.raises(ConfigError, match=r"^resume: .*optimizer_steps_per_rollout 1 -> 2 "):
        check_resumed_plan(saved, load_config(None, [*BASE, "actor.ppo_epochs=2"]))
    constant = "actor_train.training_args.lr_scheduler_type=constant"
    check_resumed_plan(saved, load_config(None, [*BASE, constant, "actor.ppo_epochs=2"]))
    fixed = "actor.optim.total_training_steps=100"
    check_resumed_plan(saved, load_config(None, [*BASE, fixed, "actor.ppo_epochs=2"]))

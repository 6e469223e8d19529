"""verl's actor keys (issue 15 item 3): the seed's actor block loads; every key means what it
meant in verl (micro-batches, the optimizer and its schedule, torch.compile); verl's and ROLL's
twin keys follow one rule; ignored keys, deprecations and conflicts are one line each."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from asyncrl.config import derive_plan, load_config
from asyncrl.config.rules import TORCH_COMPILE_STRATEGIES
from asyncrl.config.schema import ConfigError
from asyncrl.config.validate import validate

# The seed's actor block (verl's actor config, as the project's reference document holds it,
# `|` separator lines dropped), kept in the repository: CI runs on a clone without ../shared.
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "verl_actor_block.txt"
SEED = (
    Path(__file__).resolve().parents[2] / "shared/reference/verl-rollout-is-pr-and-actor-config.txt"
)
# The scrape kept verl's actor.yaml line by line but lost its indentation. These are verl's
# nested blocks (verl/trainer/config/actor/actor.yaml) and the keys each holds: enough to put
# every line back at its depth, and nothing else changes (the test checks that).
BLOCKS = {
    "policy_loss": {"_target_", "loss_mode", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub",
                    "kl_cov_ratio", "ppo_kl_coef"},
    "checkpoint": {"_target_", "save_contents", "load_contents", "async_save"},
    "optim": {"lr", "lr_warmup_steps_ratio", "total_training_steps", "weight_decay",
              "lr_warmup_steps"},
    "profiler": {"_target_", "tool", "enable", "all_ranks", "ranks", "save_path", "tool_config"},
    "tool_config": {"nsys", "npu", "torch", "torch_memory"},
    "nsys": {"_target_", "discrete"},
    "npu": {"_target_", "contents", "level", "analysis", "discrete"},
    "torch": {"_target_", "step_start", "step_end"},
    "torch_memory": {"_target_", "trace_alloc_max_entries", "stack_depth"},
}  # fmt: skip


def seed_actor_lines() -> list[str]:
    """The seed's actor block: from verl's file header to the end, `|` separators dropped."""
    return FIXTURE.read_text(encoding="utf-8").splitlines()


@pytest.mark.skipif(not SEED.is_file(), reason="the project's reference documents are not here")
def test_the_fixture_is_the_seed_block_unchanged():
    lines = SEED.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Format checks"))
    assert seed_actor_lines() == [line for line in lines[start:] if line.strip() != "|"]


def reindent(lines: list[str]) -> list[str]:
    """Each key line at its block's depth (see BLOCKS); comments at the next key's depth."""
    out, stack, comments = [], [], []
    for line in lines:
        if line.lstrip().startswith("#") or not line.strip():
            comments.append(line.strip())
            continue
        key, _, value = line.partition(":")
        while stack and key not in BLOCKS[stack[-1]]:
            stack.pop()
        out += ["  " * len(stack) + c for c in comments] + ["  " * len(stack) + line]
        comments = []
        if key in BLOCKS and not value.strip():
            stack.append(key)
    return out


def seed_config(tmp_path, edit=lambda text: text, *overrides):
    lines = reindent(seed_actor_lines())
    assert [x.strip() for x in lines] == [x.strip() for x in seed_actor_lines()]  # unchanged
    text = "actor:\n" + "\n".join("  " + x for x in lines) + "\n"
    path = tmp_path / "verl.yaml"
    path.write_text(edit(text))
    return load_config(path, [f"output_dir={tmp_path / 'out'}", *overrides])


def test_seed_actor_block_loads_unchanged(tmp_path, capsys):
    cfg = seed_config(tmp_path)
    assert cfg.actor.use_torch_compile is True


def test_seed_actor_block_loads_with_verl_meaning(tmp_path, capsys):
    """The unchanged block, read with verl's meaning."""
    cfg = seed_config(tmp_path)
    targs = cfg.actor_train.training_args
    assert (targs.learning_rate, targs.weight_decay, targs.warmup_steps) == (1e-6, 0.01, 0)
    assert cfg.actor.checkpoint.load_contents == ["model", "optimizer", "extra"]  # ${.x}
    assert cfg.actor.ppo_mini_batch_size == 256 and cfg.actor.clip_ratio_low == 0.2
    assert cfg.actor.profiler.tool is None and cfg.actor.profiler.enable is False
    assert cfg.actor.profiler.tool_config["torch_memory"]["stack_depth"] == 32  # oc.select
    assert cfg.actor.profiler.tool_config["nsys"]["discrete"] is None  # no default: null
    warnings = [x for x in capsys.readouterr().err.splitlines() if "ignored" in x]
    assert len(warnings) == 1, warnings
    for key in ("actor.strategy", "actor.freeze_vision_tower", "actor.use_fused_kernels"):
        assert key in warnings[0]
    assert "_target_ (8x" in warnings[0]


def _load(*overrides):
    return load_config(None, list(overrides))


# -- interpolations, ???, ignored keys -------------------------------------------------------
def test_unsupported_interpolation_is_one_line():
    with pytest.raises(ConfigError, match=r"^actor.ppo_epochs: interpolation .*write the value$"):
        _load("actor.ppo_epochs=${data.epochs}")


def test_missing_marker_on_a_read_key_is_one_line_and_fine_on_an_ignored_one():
    with pytest.raises(ConfigError, match=r"^actor.optim.lr: '\?\?\?' .* needs a value$"):
        _load("actor.optim.lr=???")
    assert _load("actor.strategy=???", "actor.freeze_vision_tower=???").actor.optim.lr is None


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("actor.freeze_vision_tower=true", "no vision tower"),
        ("actor.use_fused_kernels=true", "attn_implementation"),
        ("actor.use_remove_padding=true", "use_dynamic_bsz"),
        ("actor.ulysses_sequence_parallel_size=2", "context_parallel_size"),
        ("actor.strategy=megatron", "strategy_name is 'fsdp2_train'"),
        ("actor.strategy=deepspeed", "not one of fsdp, fsdp2, megatron"),
    ],
)
def test_keys_that_would_change_something_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        _load(override)


def test_ignored_keys_give_one_warning_line(capsys):
    _load("actor.strategy=fsdp", "actor._target_=x.Y", "actor.optim._target_=x.Z",
          "actor.use_fused_kernels=false")  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "asyncrl: warning: verl keys asyncrl has no use for, ignored: "
        "actor.use_fused_kernels, _target_ (2x, verl class paths)"
    ]  # a strategy that names actor_train's backend is checked, not ignored


# -- the rule for verl's keys and their ROLL twins ---------------------------------------------
def test_defaults_keep_rolls_values():
    cfg, default = _load(), load_config(None).actor_train.training_args
    assert cfg.actor_train.training_args == default and cfg.actor.optim.lr is None


@pytest.mark.parametrize(
    ("verl", "roll", "field", "value"),
    [
        ("actor.optim.lr=3e-4", None, "learning_rate", 3e-4),
        (None, "learning_rate=2e-4", "learning_rate", 2e-4),
        ("actor.optim.lr=3e-4", "learning_rate=3e-4", "learning_rate", 3e-4),
        ("actor.optim.weight_decay=0.1", None, "weight_decay", 0.1),
        ("actor.optim.clip_grad=0.5", None, "max_grad_norm", 0.5),
        ("actor.optim.lr_scheduler_type=cosine", None, "lr_scheduler_type", "cosine"),
        ("actor.optim.lr_warmup_steps=3", None, "warmup_steps", 3),
        ("actor.optim.lr_warmup_steps=-1", "warmup_steps=4", "warmup_steps", 4),
        ("actor.ppo_micro_batch_size_per_gpu=4", None, "per_device_train_batch_size", 4),
    ],
)
def test_one_given_wins(verl, roll, field, value):
    overrides = [verl] if verl else []
    overrides += [f"actor_train.training_args.{roll}"] if roll else []
    assert getattr(_load(*overrides).actor_train.training_args, field) == value


@pytest.mark.parametrize(
    ("verl", "roll"),
    [
        ("actor.optim.lr=3e-4", "learning_rate=5e-5"),  # explicitly ROLL's default: still set
        ("actor.optim.weight_decay=0.1", "weight_decay=0.0"),
        ("actor.optim.clip_grad=0.5", "max_grad_norm=1.0"),
        ("actor.optim.lr_warmup_steps=3", "warmup_steps=2"),
        ("actor.optim.lr_warmup_steps_ratio=0.5", "warmup_steps=1"),
        ("actor.ppo_micro_batch_size_per_gpu=4", "per_device_train_batch_size=8"),
    ],
)
def test_both_given_and_different_is_one_line_naming_both(verl, roll):
    with pytest.raises(ConfigError) as err:
        _load(verl, f"actor_train.training_args.{roll}", "max_steps=4")
    line = str(err.value)
    assert "\n" not in line and verl.split("=")[0] in line
    assert f"actor_train.training_args.{roll.split('=')[0]}" in line


def test_cosine_cycles_other_than_half_are_refused():
    assert _load("actor.optim.num_cycles=0.5").actor.optim.num_cycles == 0.5
    with pytest.raises(ConfigError, match=r"^actor.optim.num_cycles: 1.0 is not supported"):
        _load("actor.optim.num_cycles=1.0")


def test_config_built_in_code_must_agree():
    cfg = _load()
    actor = dataclasses.replace(cfg.actor, optim=dataclasses.replace(cfg.actor.optim, lr=1e-3))
    with pytest.raises(ConfigError, match="actor.optim.lr .* differs from .*learning_rate"):
        validate(dataclasses.replace(cfg, actor=actor))


def test_the_resolved_config_reloads_unchanged(tmp_path):
    """A run writes its resolved config (both twins set, equal): reading it back is no
    conflict and means the same."""
    import yaml

    from asyncrl.config import to_dict

    cfg = _load("actor.optim.lr=1e-3", "actor.optim.lr_warmup_steps_ratio=0.5",
                "actor.ppo_micro_batch_size=8", "max_steps=4")  # fmt: skip
    path = tmp_path / "resolved.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    assert load_config(path) == cfg


def test_warmup_style_is_the_deprecated_scheduler_name(capsys):
    cfg = _load("actor.optim.warmup_style=cosine")
    assert cfg.actor_train.training_args.lr_scheduler_type == "cosine"
    assert capsys.readouterr().err.count("deprecated") == 1
    with pytest.raises(ConfigError, match="both set"):
        _load("actor.optim.warmup_style=cosine", "actor.optim.lr_scheduler_type=linear")


# -- micro-batches -----------------------------------------------------------------------------
def test_deprecated_global_micro_batch_is_divided_by_data_parallel_ranks(capsys):
    cfg = _load("actor.ppo_micro_batch_size=8", "actor_train.device_mapping=[0,1]")
    assert cfg.actor_train.training_args.per_device_train_batch_size == 4
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "asyncrl: warning: actor.ppo_micro_batch_size is deprecated (verl): read as "
        "ppo_micro_batch_size_per_gpu = 8 / 2 data-parallel ranks = 4"
    ]
    with pytest.raises(ConfigError, match="not divisible by the 2 data-parallel"):
        _load("actor.ppo_micro_batch_size=5", "actor_train.device_mapping=[0,1]")
    with pytest.raises(ConfigError, match="both set"):
        _load("actor.ppo_micro_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=4")


def _learner(model_dir, *overrides):
    """The learner as the run builds it: its schedule sized by the run (`build_learner`)."""
    from asyncrl.run import build_learner

    cfg = _load("actor_train.model_args.disable_gradient_checkpointing=true", *overrides)
    return cfg, build_learner(cfg, model_dir)


def test_micro_batch_size_per_gpu_sets_the_learners_micro_batches(tiny_model):
    from tests.test_torch_learner import _groups

    counts = {}
    for size in (1, 3):
        # rows run whole: one forward per micro-batch (shared prompts take two)
        key = f"actor.ppo_micro_batch_size_per_gpu={size}"
        _, learner = _learner(tiny_model, key, "actor.share_prompt_forward=false")
        calls: list[int] = []

        def count(*_, calls=calls):  # training forwards only (recomputes run without grad)
            calls.extend([1] if torch.is_grad_enabled() else [])

        learner.model.register_forward_hook(count)
        learner.step(_groups(n_groups=2, n=3))  # 6 sequences, one optimizer step
        counts[size] = len(calls)
        learner.close()
    assert counts == {1: 6, 3: 2}


# -- the learning-rate schedule ----------------------------------------------------------------
def test_warmup_ratio_reaches_the_optimizer(tiny_model):
    cfg, learner = _learner(
        tiny_model, "max_steps=8", "actor.optim.lr=1e-3", "actor.optim.lr_warmup_steps_ratio=0.5"
    )
    assert cfg.actor_train.training_args.warmup_steps == 4  # int(0.5 × 8 optimizer steps)
    lrs = []
    for _ in range(6):
        lrs.append(learner.optimizer.param_groups[0]["lr"])
        learner.optimizer.step()  # no gradients: the weights stay; the schedule advances
        learner.scheduler.step()
    learner.close()
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_the_runs_schedule_counts_every_optimizer_step(tiny_model):
    """Two optimizer steps a rollout (6 sequences in mini-batches of 3): the ratio and the decay
    are of the run's 8 optimizer steps, not of its 4 rollouts; the lr that each real rollout
    reports reaches 0 after the last one, not halfway."""
    from tests.test_torch_learner import _groups

    cfg, learner = _learner(
        tiny_model, "max_steps=4", "rollout_batch_size=2", "num_return_sequences_in_group=3",
        "actor.ppo_mini_batch_size=3", "actor.optim.lr=1e-3",
        "actor.optim.lr_warmup_steps_ratio=0.5", "actor.optim.lr_scheduler_type=linear",
    )  # fmt: skip
    assert cfg.actor_train.training_args.warmup_steps == 4  # int(0.5 × 8 optimizer steps)
    lrs = [learner.step(_groups(n_groups=2, n=3, seed=r))["learner/lr"] for r in range(4)]
    learner.close()
    # after steps 2, 4 (warm-up done), 6 (half the decay) and 8 (its end)
    assert lrs == pytest.approx([7.5e-4, 1e-3, 5e-4, 0.0])


def test_total_training_steps_is_the_schedules_horizon():
    from asyncrl.learner.objective import lr_factor

    cfg = _load("max_steps=100", "actor.optim.lr_scheduler_type=linear",
                "actor.optim.total_training_steps=10", "actor.optim.lr_warmup_steps_ratio=0.2")  # fmt: skip
    targs = cfg.actor_train.training_args
    assert targs.warmup_steps == 2  # int(0.2 × 10), not × 100
    factor = lr_factor(targs, cfg.actor.optim, total_steps=100)
    assert [factor(s) for s in (0, 1, 2, 6, 10, 50)] == pytest.approx([0.5, 1, 1, 0.5, 0, 0])
    # null: the run's optimizer steps, 2 a rollout (64 sequences in mini-batches of 32)
    run = _load("max_steps=100", "actor.ppo_mini_batch_size=32")
    run_horizon = lr_factor(targs, run.actor.optim, total_steps=derive_plan(run).schedule_horizon)
    assert run_horizon(6) == pytest.approx(1 - 4 / 198)


# -- torch.compile ---------------------------------------------------------------------------
def test_use_torch_compile_is_refused_where_no_learner_compiles():
    strategies = {"fsdp2_train", "megatron_train"} - set(TORCH_COMPILE_STRATEGIES)
    assert "megatron_train" in strategies  # the Megatron path has no compile hook
    for name in strategies:
        with pytest.raises(ConfigError, match=f"^actor.use_torch_compile: the {name} learner"):
            _load("actor.use_torch_compile=true",
                  f"actor_train.strategy_args.strategy_name={name}")  # fmt: skip


def _tiny_and_ids():
    from tests.helpers import random_qwen2

    torch.manual_seed(0)
    return random_qwen2(seed=0), torch.randint(0, 64, (3, 9))


def test_compiled_forward_equals_eager_and_keeps_the_module():
    from asyncrl.learner.compile import maybe_compile

    model, ids = _tiny_and_ids()
    names = list(model.state_dict())
    with torch.no_grad():
        eager = model(ids).logits
        assert maybe_compile(model, True, backend="aot_eager") is model
        compiled = model(ids).logits
    assert model._compiled_call_impl is not None  # the compiled path answered
    assert list(model.state_dict()) == names  # weight sync and checkpoints see the same names
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert maybe_compile(model, False) is model


@pytest.mark.slow
def test_inductor_compiled_forward_equals_eager():
    """The default backend, which builds C++ kernels on the CPU (minutes on a small box)."""
    from asyncrl.learner.compile import compile_unavailable, maybe_compile

    if compile_unavailable():
        pytest.skip(compile_unavailable())
    model, ids = _tiny_and_ids()
    with torch.no_grad():
        eager = model(ids).logits
        torch.testing.assert_close(maybe_compile(model, True)(ids).logits, eager)


def test_compile_failure_falls_back_to_eager_with_one_logged_line(caplog):
    from asyncrl.learner.compile import maybe_compile

    def broken_backend(gm, example_inputs):
        raise RuntimeError("no kernels today")

    model, ids = _tiny_and_ids()
    with torch.no_grad():
        eager = model(ids).logits
        maybe_compile(model, True, backend=broken_backend)
        with caplog.at_level(logging.WARNING, logger="asyncrl"):
            first, second = model(ids).logits, model(ids).logits
    torch.testing.assert_close(first, eager)
    torch.testing.assert_close(second, eager)
    lines = [r.getMessage() for r in caplog.records if "use_torch_compile" in r.getMessage()]
    assert len(lines) == 1 and "compile failed, running eager" in lines[0]
    assert model._compiled_call_impl is None


def test_no_c_compiler_runs_eager_with_one_logged_line(monkeypatch, caplog):
    import asyncrl.learner.compile as compile_mod

    monkeypatch.setattr(compile_mod.shutil, "which", lambda name: None)  # the machine's edge
    model, _ = _tiny_and_ids()
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        assert compile_mod.maybe_compile(model, True) is model
    assert model._compiled_call_impl is None
    assert [r.getMessage() for r in caplog.records] == [
        "asyncrl: use_torch_compile: running eager: no C/C++ compiler on PATH (inductor "
        "builds its CPU kernels with one)"
    ]


@pytest.mark.slow
def test_the_learner_trains_a_compiled_model(tiny_model):
    """use_torch_compile reaches the fsdp2_train learner: its model is compiled (same module,
    same names) and a step trains (inductor: minutes on a small CPU box)."""
    from tests.test_torch_learner import _groups

    _, learner = _learner(tiny_model, "actor.use_torch_compile=true")
    assert learner.model._compiled_call_impl is not None
    metrics = learner.step(_groups(n_groups=2, n=3))
    learner.close()
    assert learner.model._compiled_call_impl is not None  # compiled, no fall-back
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))

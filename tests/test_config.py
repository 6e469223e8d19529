"""Config: loading, overrides, every validation error, the derived plan, shipped files."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, derive_plan, load_config, schema, to_dict
from asyncrl.config.loader import parse_int_list

ROOT = Path(__file__).resolve().parent.parent


def _load(*overrides: str):
    return load_config(None, list(overrides))


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        _load(*overrides)
    message = str(info.value)
    assert "\n" not in message, "config errors are one line"
    return message


def test_every_field_has_a_docstring():
    from asyncrl.config import schema_actor, schema_run, schema_worker

    classes = [
        n
        for module in (schema, schema_actor, schema_run, schema_worker)  # re-exported sections
        for n in ast.parse(inspect.getsource(module)).body
        if isinstance(n, ast.ClassDef)
    ]
    assert {"ActorConfig", "Config", "ClusterConfig"} <= {c.name for c in classes}
    missing = []
    for cls in classes:
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                documented = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                if not documented:
                    missing.append(f"{cls.name}.{node.target.id}")
    assert not missing, f"fields without docstrings: {missing}"


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    derive_plan(cfg)


def test_default_yaml_is_the_embedded_default():
    assert load_config(ROOT / "configs" / "default.yaml") == load_config()


def test_dotted_override_and_types():
    cfg = _load(
        "actor_train.training_args.learning_rate=1e-6",
        "async.max_staleness=3",
        "algorithm.rollout_is_threshold=null",
        "actor_train.device_mapping=list(range(0,16))",
    )
    assert cfg.actor_train.training_args.learning_rate == pytest.approx(1e-6)
    assert cfg.async_.max_staleness == 3
    assert cfg.algorithm.rollout_is_threshold is None
    assert cfg.actor_train.device_mapping == list(range(16))


def test_yaml_file_with_nested_lists(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "algorithm:\n  rollout_rs:\n    - {name: token_k1, lower: -2.0, upper: 2.0}\n"
        "    - {name: seq_max_k2, upper: 5}\n"
        "actor_infer:\n  device_mapping: list(range(0, 8, 2))\n"
    )
    cfg = load_config(path)
    assert [c.name for c in cfg.algorithm.rollout_rs] == ["token_k1", "seq_max_k2"]
    assert cfg.algorithm.rollout_rs[1].upper == 5.0
    assert cfg.actor_infer.device_mapping == [0, 2, 4, 6]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("list(range(0,16))", list(range(16))),
        ("list(range(4))", [0, 1, 2, 3]),
        ("range(2, 6)", [2, 3, 4, 5]),
        ("0,1,3", [0, 1, 3]),
        ("[5]", [5]),
    ],
)
def test_device_mapping_is_parsed(text, expected):
    assert parse_int_list(text, "x") == expected


def test_device_mapping_is_never_evaluated():
    msg = _error("actor_train.device_mapping=__import__('os').system('true')")
    assert "actor_train.device_mapping" in msg and "cannot parse" in msg


def test_unknown_key_names_path_and_closest():
    msg = _error("actor_train.training_args.learnig_rate=1")
    assert "actor_train.training_args.learnig_rate" in msg
    assert "learning_rate" in msg


def test_wrong_type_names_path_and_expected_type():
    msg = _error("actor_train.training_args.per_device_train_batch_size=two")
    assert "actor_train.training_args.per_device_train_batch_size" in msg and "int" in msg
    msg = _error("algorithm.rollout_is_level=tokens")
    assert "algorithm.rollout_is_level" in msg and "sequence" in msg


def test_an_unpaused_sync_needs_engines_that_hold_the_buckets():
    msg = _error("async.pause_mode=none", "actor_infer.strategy_args.strategy_name=sglang")
    assert msg.startswith("async.pause_mode: none needs hf_infer engines; sglang loads")
    assert load_config(None, ["async.pause_mode=none"]).async_.pause_mode == "none"


def test_pause_mode_auto_skips_the_pause_only_on_engines_that_hold_the_buckets():
    from asyncrl.config.async_checks import pause_mode

    assert load_config(None, []).async_.pause_mode == "auto"
    assert pause_mode(load_config(None, [])) == "none"  # hf_infer loads a sync at once
    sglang = ["actor_infer.strategy_args.strategy_name=sglang"]
    assert pause_mode(load_config(None, sglang)) == "in_place"  # it loads bucket by bucket
    assert pause_mode(load_config(None, ["async.pause_mode=abort"])) == "abort"  # as given


def test_an_overlapped_sync_is_refused_with_the_wait_policy():
    msg = _error("weight_sync.overlap=always", "async.stale_policy=wait")
    assert msg.startswith("weight_sync.overlap: always with async.stale_policy: wait")


def test_prompt_and_messages_conflict():
    msg = _error("actor_train.data_args.prompt=q", "actor_train.data_args.messages=m")
    assert "prompt" in msg and "messages" in msg


@pytest.mark.parametrize(
    "key", ["actor.tis_imp_ratio_cap", "actor_rollout_ref.actor.tis_imp_ratio_cap"]
)
def test_removed_tis_key_gives_migration(key):
    msg = _error(f"{key}=2.0")
    assert "tis_imp_ratio_cap" in msg and "algorithm.rollout_is_threshold" in msg


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("actor_train.strategy_args.strategy_name=deepspeed_train", "fsdp2_train"),
        ("actor_infer.strategy_args.strategy_name=vllm", "sglang"),
        ("actor_infer.strategy_args.strategy_name=megatron_train", "sglang, hf_infer"),
        ("rollout_batch_size=0", "rollout_batch_size"),
        ("async.max_staleness=-1", "async.max_staleness"),
        ("actor.clip_ratio_c=0.5", "clip_ratio_c"),
        ("actor.policy_loss.loss_mode=ppo2", "loss_mode"),
        ("actor.loss_agg_mode=mean", "loss_agg_mode"),
        ("actor.kl_loss_type=k9", "kl_loss_type"),
        ("algorithm.adv_estimator=gae", "critic"),
        ("algorithm.rollout_is_threshold_lower=3.0", "rollout_is_threshold_lower"),
        ("algorithm.rollout_is_veto_threshold=2", "veto"),
        ("actor_infer.generating_args.max_new_tokens=9999", "max_new_tokens"),
        ("actor_infer.generating_args.top_p=0", "top_p"),
        ("actor.checkpoint.save_contents=[model,weights]", "save_contents"),
        ("actor_train.device_mapping=[0,0]", "twice"),
        ("async.pause_mode=drop", "abort"),
    ],
)
def test_semantic_errors(override, fragment):
    assert fragment in _error(override)


SC = "strategy_args.strategy_config"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [f"actor_infer.{SC}.max_batch_sise=4"],
            f"actor_infer.{SC}.max_batch_sise is not read by hf_infer; did you mean "
            "'max_batch_size'?",
        ),
        (
            [f"actor_train.{SC}.offload_param=true"],
            f"actor_train.{SC}.offload_param is not read by fsdp2_train; did you mean "
            "'offload_params'?",
        ),
        (
            [f"actor_train.{SC}.fsdp_size=2"],
            f"actor_train.{SC}.fsdp_size: verl's fsdp_size is not supported by asyncrl's "
            "fsdp2_train (it shards over every actor_train device, no hybrid-shard groups)",
        ),
        (
            [f"actor_train.{SC}.tensor_model_parallel_size=1"],
            f"actor_train.{SC}.tensor_model_parallel_size: a Megatron parallel size; "
            "fsdp2_train has no such parallelism: use megatron_train",
        ),
        (
            ["actor_train.strategy_args.strategy_name=megatron_train",
             f"actor_train.{SC}.tensor_model_paralel_size=2"],
            f"actor_train.{SC}.tensor_model_paralel_size is not read by megatron_train; did "
            "you mean 'tensor_model_parallel_size'?",
        ),
        (
            ["actor_train.strategy_args.strategy_name=megatron_train",
             f"actor_train.{SC}={{recompute_granularity: full, recompute_method: block}}"],
            f"actor_train.{SC}.recompute_method needs recompute_num_layers",
        ),
        (
            ["actor_train.strategy_args.strategy_name=megatron_train",
             f"actor_train.{SC}.transformer_impl=apex"],
            f"actor_train.{SC}.transformer_impl: 'apex' is not one of local, "
            "transformer_engine, auto",
        ),
        (
            ["actor_train.strategy_args.strategy_name=megatron_train",
             f"actor_train.{SC}.param_offload=true"],
            f"actor_train.{SC}.param_offload: verl's param_offload is not supported by "
            "asyncrl's megatron_train (asyncrl's megatron_train does not offload to the host)",
        ),
        (
            ["actor.use_kl_loss=true", f"reference.{SC}.max_batch_size=4"],
            f"reference.{SC}.max_batch_size is not read by fsdp2_train for reference (the "
            "reference runs inside the learner, on actor_train's backend: its strategy_config "
            "is not read)",
        ),
        (
            [f"actor_infer.{SC}.server_urls=[http://h:1]"],
            f"actor_infer.{SC}.server_urls is not read by hf_infer (it reads max_batch_size)",
        ),
        (
            [f"actor_infer.{SC}.max_batch_size=0"],
            f"actor_infer.{SC}.max_batch_size must be a positive int, got 0",
        ),
    ],
)  # fmt: skip
def test_strategy_config_keys_are_read_or_refused(overrides, message):
    assert _error(*overrides) == message


def test_strategy_config_read_keys_and_passthrough_load():
    cfg = _load(f"actor_infer.{SC}.max_batch_size=4")
    assert cfg.actor_infer.strategy_args.strategy_config == {"max_batch_size": 4}
    mega = _load(
        "actor_train.strategy_args.strategy_name=megatron_train",
        f"actor_train.{SC}={{sequence_parallel: true, moe_router_topk: 2, use_bridge: false}}",
    )
    assert mega.actor_train.strategy_args.strategy_config["moe_router_topk"] == 2
    # SGLang's keys are its server flags: its own parser judges them when the servers start.
    sgl = _load("actor_infer.strategy_args.strategy_name=sglang", f"actor_infer.{SC}.any_flag=1")
    assert sgl.actor_infer.strategy_args.strategy_config == {"any_flag": 1}


def test_verl_fsdp_offload_names_are_read_as_asyncrl_keys():
    devices = "actor_train.device_mapping=[0,1]"
    for verl, own in (("param_offload", "offload_params"), ("offload_policy", "offload_params"),
                      ("optimizer_offload", "offload_optimizer")):  # fmt: skip
        cfg = _load(devices, f"actor_train.{SC}.{verl}=true")
        assert cfg.actor_train.strategy_args.strategy_config == {own: True}
    both = _error(devices, f"actor_train.{SC}.param_offload=true",
                  f"actor_train.{SC}.offload_params=false")  # fmt: skip
    assert both == (f"actor_train.{SC}.param_offload (verl's name of offload_params) is True "
                    f"and actor_train.{SC}.offload_params is False: set one")  # fmt: skip


def test_rejection_criterion_validated():
    assert "rollout_rs[0].name" in _error("algorithm.rollout_rs=[{name: token_k7, upper: 1}]")
    assert "needs lower or upper" in _error("algorithm.rollout_rs=[{name: token_k1}]")


def test_bad_yaml_and_non_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_round_trip_through_dict():
    cfg = _load("actor.policy_loss.loss_mode=gspo", "async.max_staleness=4")
    again = load_config(None, [])
    from asyncrl.config.loader import build

    rebuilt = build(schema.Config, to_dict(cfg), "")
    assert rebuilt == cfg and again != cfg
    assert "async" in to_dict(cfg) and "async_" not in to_dict(cfg)


def test_plan_data_parallel_formula():
    cfg = _load(
        "rollout_batch_size=64",
        "num_return_sequences_in_group=8",
        "actor_train.device_mapping=list(range(0,16))",
        "actor_train.training_args.per_device_train_batch_size=2",
        "actor_train.training_args.gradient_accumulation_steps=4",
    )
    plan = derive_plan(cfg)
    assert plan.global_train_batch_size == 2 * 4 * 16
    assert plan.derived_gradient_accumulation_steps == 64 * 8 // (2 * 16)
    assert plan.optimizer_steps_per_rollout == pytest.approx(512 / 128)
    assert not plan.warnings


def test_plan_megatron_divides_by_tp_pp_cp_not_ep():
    cfg = _load(
        "rollout_batch_size=64",
        "num_return_sequences_in_group=8",
        "actor_train.strategy_args.strategy_name=megatron_train",
        "actor_train.strategy_args.strategy_config={tensor_model_parallel_size: 2, "
        "pipeline_model_parallel_size: 2, context_parallel_size: 2, expert_model_parallel_size: 4, "
        "sequence_parallel: true, use_bridge: true}",
        "actor_train.model_args.embedded_arch=moe",  # EP splits experts: a dense model refuses it
        "actor_train.device_mapping=list(range(0,16))",
        "actor_train.training_args.per_device_train_batch_size=1",
        "actor_train.training_args.gradient_accumulation_steps=32",
    )
    plan = derive_plan(cfg)
    assert plan.model_parallel == 8 and plan.data_parallel == 2
    assert plan.global_train_batch_size == 1 * 32 * 16 // 8
    assert plan.derived_gradient_accumulation_steps == 64 * 8 * 8 // (1 * 16)


def test_plan_warns_when_sizes_do_not_divide():
    cfg = _load(
        "rollout_batch_size=3",
        "num_return_sequences_in_group=3",
        "actor_train.device_mapping=[0,1]",
        "actor_train.training_args.per_device_train_batch_size=2",
    )
    plan = derive_plan(cfg)
    assert plan.warnings and "not divisible" in plan.warnings[0]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True, cwd=ROOT
    )


def test_cli_show_prints_config_and_plan():
    out = _cli(
        "config", "show", "configs/default.yaml", "actor_train.training_args.learning_rate=1e-6"
    )
    assert out.returncode == 0, out.stderr
    assert "learning_rate: 1.0e-06" in out.stdout
    assert "global_train_batch_size" in out.stdout


def test_cli_error_is_one_line_without_traceback():
    out = _cli("config", "validate", "actor.tis_imp_ratio_cap=2")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "algorithm.rollout_is_threshold" in out.stderr


def test_cli_does_not_import_heavy_modules():
    code = (
        "import sys; from asyncrl.cli import main; main(['config', 'validate']); "
        "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip().endswith("[]"), out.stdout + out.stderr


def test_config_dataclasses_are_plain():
    for cls in (schema.Config, schema.WorkerConfig, schema.AlgorithmConfig, schema.ActorConfig):
        assert dataclasses.is_dataclass(cls)

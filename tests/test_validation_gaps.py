"""Validation gaps of issue 14: every value a run would refuse late, honour wrongly or allocate
without bound is refused when the config loads, with one line naming the key (or file and line).
"""

from __future__ import annotations

import time

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.loader import parse_int_list, parse_yaml
from asyncrl.config.validate import MAX_DEVICES, MIN_TEMPERATURE

GEN = "actor_infer.generating_args"
LR = "actor_train.training_args.learning_rate"


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    message = str(info.value)
    assert "\n" not in message, "config errors are one line"
    return message


# (override, the key the message must name, a fragment saying what is wrong)
BAD = [
    ("rollout.transport_port=99999", "rollout.transport_port", "0..65535"),
    ("rollout.transport_port=-1", "rollout.transport_port", "0..65535"),
    ("weight_sync.master_port=70000", "weight_sync.master_port", "0..65535"),
    ("weight_sync.timeout_s=-1", "weight_sync.timeout_s", "> 0"),
    ("rollout.request_timeout_s=-5", "rollout.request_timeout_s", "> 0"),
    ("rollout.request_timeout_s=0", "rollout.request_timeout_s", "> 0"),
    (f"{LR}=.inf", LR, "finite"),
    (f"{LR}=.nan", LR, "finite"),
    (f"{LR}=-1e-6", LR, "> 0"),
    (f"{LR}=0", LR, "> 0"),
    ("actor_train.training_args.warmup_steps=-1", "warmup_steps", ">= 0"),
    ("actor_train.training_args.max_grad_norm=-1", "max_grad_norm", ">= 0"),
    ("weight_sync.bucket_size_mb=.inf", "weight_sync.bucket_size_mb", "finite"),
    ("algorithm.rollout_is_threshold=.nan", "algorithm.rollout_is_threshold", "finite"),
    ("actor.optim.betas=[0.9, .inf]", "actor.optim.betas[1]", "finite"),
    ("actor.optim.betas=[0.9]", "actor.optim.betas", "two values"),
    ("actor.optim.eps=0", "actor.optim.eps", "> 0"),
    ("algorithm.gamma=1.5", "algorithm.gamma", "[0, 1]"),
    ("actor.checkpoint.save_interval=-1", "actor.checkpoint.save_interval", ">= 0"),
    ("logging.eval_interval=-2", "logging.eval_interval", ">= 0"),
    ("actor.checkpoint.resume=bogus", "actor.checkpoint.resume", "never, auto"),
    ("rollout.reward_fn=bogus", "rollout.reward_fn", "valid names: arithmetic_exact"),
    ("rollout.reward_fn=no_such_module_xyz:f", "rollout.reward_fn", "cannot import"),
    ("rollout.reward_fn=asyncrl.rewards.arithmetic:nope", "rollout.reward_fn", "no attribute"),
    ("actor_train.device_mapping=list(range(0,1000000000))", "device_mapping", "1000000000"),
    ("actor_train.device_mapping=list(range(0,100000))", "device_mapping", str(MAX_DEVICES)),
    ("actor_train.device_mapping=list(range(0,8,0))", "device_mapping", "step of 0"),
    ("actor_train.device_mapping=[0,99999999]", "device_mapping", "99999999"),
    ("actor_train.device_mapping=[-1]", "device_mapping", "-1"),
    (f"{GEN}.temperature=1e-40", f"{GEN}.temperature", "0 (greedy) or >= 1e-06"),
    (f"{GEN}.temperature=-0.5", f"{GEN}.temperature", "0 (greedy)"),
    (f"{GEN}.temperature=.inf", f"{GEN}.temperature", "finite"),
    (f"{GEN}.top_p=1.5", f"{GEN}.top_p", "(0, 1]"),
    (f"{GEN}.top_k=0", f"{GEN}.top_k", "-1 (off) or >= 1"),
    (f"{GEN}.top_k=-2", f"{GEN}.top_k", "-1 (off) or >= 1"),
    (f"{GEN}.stop_token_ids=[2,-3]", f"{GEN}.stop_token_ids[1]", ">= 0"),
    ("seed=-1", "seed", ">= 0"),
    ("rollout_batch_size=99999999999999999999999", "rollout_batch_size", "64-bit"),
    ("output_dir=''", "output_dir", "empty"),
    ("rollout.transport_host=''", "rollout.transport_host", "empty"),
    ("env.name=guess_number", "env.step_timeout_s", "> 0"),  # with the override below
]


@pytest.mark.parametrize(("override", "key", "fragment"), BAD, ids=[b[0][:60] for b in BAD])
def test_bad_value_is_one_line_naming_the_key(override, key, fragment):
    extra = ["env.step_timeout_s=-1"] if override.startswith("env.") else []
    message = _error(override, *extra)
    assert key in message and fragment in message, message


@pytest.mark.parametrize(
    "override",
    [
        f"{GEN}.temperature=0",  # greedy
        f"{GEN}.temperature={MIN_TEMPERATURE}",
        f"{GEN}.top_k=-1",
        f"{GEN}.top_k=1",
        "rollout.transport_port=0",
        "rollout.transport_port=65535",
        "actor.checkpoint.save_interval=0",
        "actor.checkpoint.resume=auto",
        "rollout.reward_fn=math_verify",  # its package is checked when the reward is built
        "rollout.reward_fn=asyncrl.rewards.arithmetic:arithmetic_partial",
        f"actor_train.device_mapping=list(range(0,{MAX_DEVICES}))",
    ],
)
def test_edge_values_still_load(override):
    load_config(None, [override])


def test_resume_names_an_existing_directory(tmp_path):
    cfg = load_config(None, [f"actor.checkpoint.resume={tmp_path}"])
    assert cfg.actor.checkpoint.resume == str(tmp_path)
    assert "does-not-exist" in _error(f"actor.checkpoint.resume={tmp_path / 'does-not-exist'}")


def test_huge_device_range_is_refused_before_it_is_expanded():
    start = time.perf_counter()
    for text in ("list(range(0,100000000000000000))", "range(0, 999999999999999999, 1)"):
        with pytest.raises(ConfigError, match="devices, more than"):
            parse_int_list(text, "actor_train.device_mapping")
    assert time.perf_counter() - start < 1.0  # measured, never allocated


def test_oversized_numbers_in_text_are_one_line(tmp_path):
    digits = "9" * 5000  # int() refuses more than 4300 digits
    assert "unreadable value" in _error(f"rollout_batch_size={digits}")
    path = tmp_path / "big.yaml"
    path.write_text(f"seed: {digits}\n")
    with pytest.raises(ConfigError, match=r"big.yaml: unreadable value") as info:
        load_config(path)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_duplicate_yaml_key_is_refused_with_its_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(
        "max_steps: 3\n"
        "actor_train:\n"
        "  training_args:\n"
        "    learning_rate: 1.0e-5\n"
        "    learning_rate: 2.0e-5\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "dup.yaml" in message and "line 5" in message and "line 4" in message
    assert "'learning_rate'" in message and "\n" not in message
    assert "duplicate key" in _error("env={name: frozenlake, name: sokoban}")


def test_yaml_merge_keys_still_override():
    data = parse_yaml("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\n")
    assert data["other"] == {"x": 3, "y": 2}


def test_non_utf8_config_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"max_steps: 3\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin1.yaml: line 2: not UTF-8 text \(byte 0xe9\)"):
        load_config(path)


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("max_steps: 3\nrollout: [1, 2\nseed: 1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: invalid YAML: line 3, column \d+") as info:
        load_config(path)
    assert "\n" not in str(info.value)

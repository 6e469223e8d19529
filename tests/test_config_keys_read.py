"""Every config key `asyncrl config validate` accepts is read by the run, or refused by a rule.

The schema's leaves (walked from `Config`, optional sections and lists of sections included)
are matched against the package outside `asyncrl/config/`, read from the AST: a leaf counts as
read where some module there accesses an attribute of its name or names it as a string (a
`getattr`, a dict key). Keys read only through another config module are listed in INDIRECT with
the module that reads them, itself checked; keys no run reads but a rule refuses (a non-default
value fails validation naming the key) in REFUSED, with the override that shows it. The same
holds for each backend's `strategy_config` keys (asyncrl.config.strategy_keys.READ).
"""

from __future__ import annotations

import ast
import dataclasses
import sys
import typing
from functools import cache
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config import strategy_keys as sk
from asyncrl.config.schema import FIELD_ALIASES, Config

PACKAGE = Path(__file__).resolve().parents[1] / "asyncrl"
CONFIG = PACKAGE / "config"

# Leaves read only inside asyncrl/config/, by a module whose result the run uses: path -> the
# reading module (the test checks it names the key).
INDIRECT = {
    # The step plan (`asyncrl.config.plan.step_size` / `mini_batches`), which both learners call.
    "actor_train.training_args.gradient_accumulation_steps": "plan.py",
    "critic.training_args.gradient_accumulation_steps": "plan.py",  # the critic's own steps
    "actor.ppo_mini_batch_size": "plan.py",
    # verl's twins, folded into actor_train.training_args when the config loads
    # (`verl_actor.fold_actor`); the learners read training_args.
    "actor.ppo_micro_batch_size_per_gpu": "verl_actor.py",
    "actor.ppo_micro_batch_size": "verl_actor.py",
    "actor.optim.lr_warmup_steps": "verl_actor.py",
    "actor.optim.lr_warmup_steps_ratio": "verl_actor.py",
    "actor.optim.warmup_style": "verl_actor.py",
}

# Leaves whose every accepted value holds by construction, so nothing needs to read them:
# path -> why.
NO_READER = {
    "actor.profiler.all_ranks": "the traced learner is one rank (verl_actor._check_profiler "
    "refuses the others), so its every rank is traced with or without verl's switch",
}

# Leaves no run reads, whose values other than the ones that change nothing are refused:
# path -> overrides validation refuses naming the path.
REFUSED = {
    "actor.optim.num_cycles": ["actor.optim.num_cycles=1.0"],
    "actor.profiler.tool_config": ["actor.profiler.tool_config={torch: {step_start: 1}}"],
    # Sections a role's worker does not read (worker_checks.SECTIONS_READ).
    "actor_infer.training_args.gradient_accumulation_steps": [
        "actor_infer.training_args.gradient_accumulation_steps=2"
    ],
    "reference.training_args.gradient_accumulation_steps": [
        "actor.use_kl_loss=true",
        "reference.training_args.gradient_accumulation_steps=2",
    ],
}


def _dataclass_of(tp: typing.Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):  # Optional[...], list[...]
        found = _dataclass_of(arg)
        if found is not None:
            return found
    return None


def schema_leaves(cls: type = Config, prefix: str = "") -> list[tuple[str, str]]:
    """(YAML path, field name) of every leaf reachable from `cls`."""
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    out = []
    for f in dataclasses.fields(cls):
        path = prefix + FIELD_ALIASES.get(f.name, f.name)
        sub = _dataclass_of(hints[f.name])
        out += schema_leaves(sub, path + ".") if sub is not None else [(path, f.name)]
    return out


def names_in(path: Path) -> set[str]:
    """Attribute names accessed and strings written in one module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    return found


@cache
def names_outside_config() -> frozenset[str]:
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if CONFIG not in path.parents:
            found |= names_in(path)
    return frozenset(found)


def unhandled(leaves: list[tuple[str, str]], read: frozenset[str]) -> list[str]:
    return [path for path, name in leaves
            if name not in read and path not in {**INDIRECT, **REFUSED, **NO_READER}]  # fmt: skip


def test_every_schema_key_is_read_or_refused():
    missing = unhandled(schema_leaves(), names_outside_config())
    assert not missing, (
        f"config keys nothing outside asyncrl/config/ reads and no rule refuses: {missing}; "
        "read them where the run uses them, refuse their non-default values with the reason "
        "(and list them in REFUSED), or name their reader in INDIRECT"
    )


@dataclasses.dataclass
class _DummySection:
    learning_rate: float = 1.0
    zz_dummy_never_read: int = 0


@dataclasses.dataclass
class _DummyRoot:
    section: _DummySection | None = None


def test_an_unread_key_fails_the_guard():
    """The guard itself: a section with a field no module reads is reported."""
    leaves = schema_leaves(_DummyRoot)
    assert leaves == [("section.learning_rate", "learning_rate"),
                      ("section.zz_dummy_never_read", "zz_dummy_never_read")]  # fmt: skip
    assert unhandled(leaves, names_outside_config()) == ["section.zz_dummy_never_read"]


@pytest.mark.parametrize("path", sorted(INDIRECT))
def test_indirect_readers_name_their_key(path):
    leaves = dict(schema_leaves())
    assert path in leaves, f"{path} is not in the schema any more: drop it from INDIRECT"
    assert leaves[path] in names_in(CONFIG / INDIRECT[path])


@pytest.mark.parametrize("path", sorted(NO_READER))
def test_no_reader_keys_are_in_the_schema(path):
    assert path in dict(schema_leaves()), f"{path} is not in the schema: drop it from NO_READER"


@pytest.mark.parametrize("path", sorted(REFUSED))
def test_refused_keys_are_refused_naming_them(path):
    assert path in dict(schema_leaves()), f"{path} is not in the schema: drop it from REFUSED"
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        load_config(None, REFUSED[path])


def test_every_declared_strategy_key_has_a_reader():
    """The strategy_config keys a backend declares are read outside config/: by name (through
    `strategy_option`) or through a tuple imported from asyncrl.config.strategy_keys."""
    read = set(names_outside_config())
    for path in PACKAGE.rglob("*.py"):
        if CONFIG in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == sk.__name__:
                for alias in node.names:
                    value = getattr(sk, alias.name)
                    read |= set(value) if isinstance(value, tuple) else set()
    for (role, name), keys in sk.READ.items():
        unread = [k for k in keys if k not in read]
        assert not unread, f"{role} {name} declares strategy_config keys nothing reads: {unread}"


def test_a_reader_cannot_ask_for_an_undeclared_key():
    cfg = Config()
    with pytest.raises(KeyError, match="max_batch_sise"):
        sk.strategy_option("actor_infer", cfg.actor_infer.strategy_args, "max_batch_sise")
    assert (
        sk.strategy_option("actor_infer", cfg.actor_infer.strategy_args, "max_batch_size", 7) == 7
    )


def test_verl_names_and_declared_keys_do_not_overlap():
    fsdp = set(sk.declared("actor_train", "fsdp2_train"))
    assert not fsdp & set(sk.VERL_FSDP_REFUSED) and not fsdp & set(sk.VERL_FSDP_NAMES)
    assert set(sk.VERL_FSDP_NAMES.values()) <= fsdp


@pytest.mark.parametrize(("config", "expected"), [({"max_batch_size": 4}, "4"), ({}, None)])
def test_the_hf_launcher_reads_its_declared_key(monkeypatch, tmp_path, config, expected):
    """`max_batch_size` reaches the hf server's command line (the process start is the edge
    faked: its command is recorded, nothing runs)."""
    from asyncrl.engine.hf import launch

    commands = []
    monkeypatch.setattr(launch, "popen", lambda cmd, env, log: commands.append(cmd))
    cfg = load_config(None, [f"actor_infer.strategy_args.strategy_config={config}"])
    launch.HFLauncher(cfg.actor_infer, tmp_path, tmp_path / "logs", seed=0).spawn(0)
    (cmd,) = commands
    assert cmd[cmd.index("--max-batch-size") + 1] == (expected or str(launch.HF_MAX_BATCH))

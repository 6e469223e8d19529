"""The config reference is generated from the schema and cannot drift from it:
`asyncrl config docs` writes docs/reference/config.md, `asyncrl config explain KEY` prints one
entry, and the committed page must equal a fresh one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.config import Config, docs, to_dict
from asyncrl.config.schema import EnvConfig, WorkerConfig

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "config.md"


def _flatten(node: object, prefix: str = "") -> dict[str, object]:
    """Leaf paths of a `to_dict` mapping (a mapping-typed field counts as a leaf when empty)."""
    if not isinstance(node, dict) or (prefix and not node):
        return {prefix: node}
    out: dict[str, object] = {}
    for key, value in node.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def test_every_schema_field_has_a_docstring():
    assert docs.missing_docstrings() == []


def test_committed_page_is_the_generated_one():
    fresh = docs.render_page()
    assert PAGE.read_text(encoding="utf-8") == fresh, (
        "docs/reference/config.md differs from the schema: run `asyncrl config docs`"
    )


def test_every_config_key_has_an_entry_with_its_default():
    entries = {e.key: e for e in docs.entries()}
    flat = _flatten(to_dict(Config()))
    # The optional sections are null by default; their entries show a given section's keys.
    for section, cls in (("reference", WorkerConfig), ("critic", WorkerConfig), ("env", EnvConfig)):
        assert flat.pop(section) is None and entries[section].default == "null"
        flat.update(_flatten(to_dict(cls()), section))
    for key, value in flat.items():
        assert key in entries, f"{key} has no reference entry"
        assert entries[key].default == docs._show(value), key
    assert not {k for k in entries if not entries[k].section and "[]" not in k} - set(flat)


def test_entries_carry_types_allowed_values_and_upstream_names():
    e = docs.find("algorithm.rollout_is_level")
    assert e.type == "one of token, sequence, geometric" and e.default == "token"
    assert "verl `algorithm.rollout_is_level`" in e.upstream
    est = docs.find("algorithm.adv_estimator")
    assert "gae" in est.allowed and "grpo" in est.allowed
    twin = docs.find("actor_train.training_args.learning_rate")
    assert "actor_rollout_ref.actor.optim.lr" in twin.upstream
    assert docs.find("actor.optim.lr").upstream.endswith("(the same setting)")
    infer = docs.find("actor_infer.strategy_args.strategy_name")
    assert infer.default == "hf_infer" and infer.allowed == ("sglang", "hf_infer")
    assert infer.backends == ("sglang", "hf_infer")
    assert docs.find("algorithm.rollout_rs[].name").allowed[0] == "token_k1"


def test_config_docs_writes_the_page(tmp_path, capsys):
    out = tmp_path / "sub" / "config.md"
    assert main(["config", "docs", "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == docs.render_page()
    assert str(out) in capsys.readouterr().out


def test_config_explain_prints_the_entry(capsys):
    assert main(["config", "explain", "async.max_staleness"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("async.max_staleness\n")
    assert "type:     int" in text and "default:  1" in text
    assert "0 is the synchronous loop" in text


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("actor_train.trainig_args.learning_rate", "actor_train.training_args.learning_rate"),
        ("async.max_stalenes", "async.max_staleness"),
    ],
)
def test_config_explain_unknown_key_is_one_line_with_a_hint(key, hint, capsys):
    assert main(["config", "explain", key]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err == f"config error: unknown key '{key}'; did you mean '{hint}'?\n"


def test_config_explain_needs_one_key(capsys):
    assert main(["config", "explain"]) == 2
    assert "give one key" in capsys.readouterr().err


def test_the_reference_imports_nothing_heavy():
    code = (
        "import sys; from asyncrl.config import docs; docs.render_page(); docs.explain('env.name');"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray', 'transformers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

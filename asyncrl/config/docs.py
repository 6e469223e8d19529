"""The config reference, generated from the schema: `asyncrl config docs` and `config explain`.

Every key reachable from `Config` gets one entry: its YAML path, type, default, allowed values,
the field's docstring (the string literal after the field, read with `ast` as
`tests/test_config.py` reads it), the backends of its role and the verl/ROLL key it stands for.
`docs/reference/config.md` is this module's output, committed; `tests/test_config_reference.py`
fails when the committed page differs from a fresh one, so the page cannot drift from the code.
Imports only the schema and its name tables (no torch, no Ray).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from asyncrl.config import rules
from asyncrl.config.schema import FIELD_ALIASES, Config, ConfigError
from asyncrl.config.verl_actor import TWINS

ROLES = ("actor_train", "actor_infer", "reference", "critic")
BACKENDS = ("fsdp2_train", "megatron_train", "megatron_infer", "hf_infer", "sglang")
# Keys whose values come from a name table `config validate` checks against (a plain `str` in
# the schema): path -> allowed values. List fields of dataclasses show their item's key as `[]`.
NAME_TABLES: dict[str, tuple[str, ...]] = {
    "algorithm.adv_estimator": rules.ADV_ESTIMATORS,
    "actor.policy_loss.loss_mode": rules.LOSS_MODES,
    "actor.loss_agg_mode": rules.LOSS_AGG_MODES,
    "actor.kl_loss_type": rules.KL_TYPES,
    "algorithm.kl_penalty": rules.KL_TYPES,
    "algorithm.rollout_rs[].name": rules.RS_CRITERIA,
    "actor.checkpoint.save_contents": rules.CHECKPOINT_CONTENTS,
    "actor.checkpoint.load_contents": rules.CHECKPOINT_CONTENTS,
    **{f"{role}.strategy_args.strategy_name": rules.STRATEGIES[role] for role in ROLES},
}
# verl's actor config keys (verl/trainer/config/actor/actor.yaml, the version whose rollout-IS
# PR asyncrl follows), relative to `actor_rollout_ref.actor`; asyncrl's `actor:` takes them as is.
VERL_ACTOR_KEYS = frozenset(
    "ppo_mini_batch_size ppo_micro_batch_size ppo_micro_batch_size_per_gpu use_dynamic_bsz "
    "ppo_max_token_len_per_gpu clip_ratio clip_ratio_low clip_ratio_high clip_ratio_c "
    "policy_loss.loss_mode policy_loss.clip_cov_ratio policy_loss.clip_cov_lb "
    "policy_loss.clip_cov_ub policy_loss.kl_cov_ratio policy_loss.ppo_kl_coef loss_agg_mode "
    "entropy_coeff use_kl_loss use_torch_compile kl_loss_coef kl_loss_type ppo_epochs shuffle "
    "checkpoint.save_contents checkpoint.load_contents checkpoint.async_save optim.lr "
    "optim.lr_warmup_steps_ratio optim.total_training_steps optim.weight_decay "
    "optim.lr_warmup_steps optim.lr_scheduler_type optim.warmup_style optim.clip_grad "
    "optim.num_cycles optim.min_lr_ratio optim.betas profiler.tool profiler.enable "
    "profiler.all_ranks profiler.ranks profiler.save_path profiler.tool_config".split()
)
# verl's `algorithm.*` keys asyncrl reads under the same name (the rollout-IS PR's six, the
# estimator and the KL-in-reward block); two algorithm keys live elsewhere in verl.
VERL_ALGORITHM_KEYS = frozenset(
    "adv_estimator norm_adv_by_std_in_grpo gamma lam use_kl_in_reward kl_penalty kl_ctrl.type "
    "kl_ctrl.kl_coef kl_ctrl.target_kl kl_ctrl.horizon rollout_is_threshold rollout_is "
    "rollout_is_threshold_lower rollout_is_level rollout_is_mode rollout_is_veto_threshold".split()
)
VERL_ELSEWHERE = {
    "algorithm.cliprange_value": "critic.cliprange_value",
    "algorithm.critic_warmup": "trainer.critic_warmup",
    "actor.profiler.steps": "global_profiler.steps",
}
# ROLL's keys (ROLL's configuration guide): the top-level sizes and, in each worker section,
# these sub-keys; asyncrl keeps their names and meaning.
ROLL_TOP = frozenset(
    "rollout_batch_size prompt_length response_length num_return_sequences_in_group".split()
)
ROLL_WORKER_KEYS = frozenset(
    "model_args model_args.model_name_or_path model_args.dtype "
    "model_args.disable_gradient_checkpointing training_args training_args.learning_rate "
    "training_args.weight_decay training_args.per_device_train_batch_size "
    "training_args.gradient_accumulation_steps training_args.warmup_steps data_args "
    "data_args.template data_args.file_name data_args.prompt data_args.messages "
    "generating_args generating_args.max_new_tokens generating_args.temperature "
    "generating_args.top_p generating_args.top_k strategy_args strategy_args.strategy_name "
    "strategy_args.strategy_config device_mapping infer_batch_size num_gpus_per_worker".split()
)


@dataclass(frozen=True)
class Entry:
    """One config key as the reference shows it."""

    key: str
    type: str
    default: str
    allowed: tuple[str, ...]
    doc: str
    backends: tuple[str, ...]
    upstream: str
    section: bool


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring (the string literal right after the field), by `ast`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = inspect.cleandoc(str(nxt.value.value))
            else:
                docs[node.target.id] = ""
    return docs


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass `tp` is, or is optional of (lists excluded: their items are rows)."""
    if typing.get_origin(tp) is list:
        return None
    for arg in (tp, *typing.get_args(tp)):
        if dataclasses.is_dataclass(arg) and isinstance(arg, type):
            return arg
    return None


def _list_item_dataclass(tp: Any) -> type | None:
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        return item if dataclasses.is_dataclass(item) else None
    return None


def type_name(tp: Any) -> str:
    """A YAML reader's name for a type hint: `int`, `float or null`, `list of str`, ..."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(map(_show, typing.get_args(tp)))
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if dataclasses.is_dataclass(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


def _literals(tp: Any) -> tuple[str, ...]:
    if typing.get_origin(tp) is Literal:
        return tuple(_show(a) for a in typing.get_args(tp))
    out: tuple[str, ...] = ()
    for arg in typing.get_args(tp):
        out += _literals(arg)
    return out


def _show(value: Any) -> str:
    """A value as it is written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"' if value == "" else value
    if isinstance(value, list | dict):
        import json

        return json.dumps(value)
    return repr(value)


def _backends(key: str, doc: str) -> tuple[str, ...]:
    """The key's role's backends (worker sections), narrowed to those its docstring names;
    outside the worker sections, the backends the docstring names, else `all`."""
    named = tuple(b for b in BACKENDS if b in doc or (b == "sglang" and "SGLang" in doc))
    role = rules.STRATEGIES.get(key.split(".", 1)[0])
    if role is None:
        return named or ("all",)
    return tuple(b for b in role if b in named) or role


def _registry_names(key: str) -> tuple[str, ...]:
    """Built-in environments and rewards (their registries list names without importing the
    environments or rewards themselves); a `package.module:name` path is accepted too."""
    if key == "env.name":
        from asyncrl.envs.registry import BUILTIN_ENVS

        return (*sorted(BUILTIN_ENVS), "package.module:Class")
    if key == "rollout.reward_fn":
        from asyncrl.rewards.registry import reward_names

        return (*reward_names(), "package.module:function")
    return ()


def upstream_name(key: str) -> str:
    """The verl or ROLL key `key` corresponds to ("" when it is asyncrl's own)."""
    head, _, rest = key.partition(".")
    names = []
    if head == "actor" and rest in VERL_ACTOR_KEYS:
        names.append(f"verl `actor_rollout_ref.actor.{rest}`")
    if head == "algorithm" and rest in VERL_ALGORITHM_KEYS:
        names.append(f"verl `algorithm.{rest}`")
    if key in VERL_ELSEWHERE:
        names.append(f"verl `{VERL_ELSEWHERE[key]}`")
    if key in ROLL_TOP or (head in ROLES and rest in ROLL_WORKER_KEYS):
        names.append(f"ROLL `{key}`")
    for verl_key, roll in TWINS.items():
        if key == f"actor_train.training_args.{roll}":
            names.append(f"verl `actor_rollout_ref.actor.{verl_key}` (the same setting)")
        if key == f"actor.{verl_key}":
            names.append(f"ROLL `actor_train.training_args.{roll}` (the same setting)")
    return "; ".join(names)


def iter_entries(cls: type = Config, prefix: str = "", base: Any = None) -> Iterator[Entry]:
    """Every key under `cls`, depth first, with defaults read from `base` (the section's
    default instance: actor_infer's defaults are not WorkerConfig's)."""
    base = cls() if base is None else base
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        key = prefix + FIELD_ALIASES.get(f.name, f.name)
        tp, doc, value = hints[f.name], docs[f.name], getattr(base, f.name)
        sub = _dataclass_in(tp)
        allowed = NAME_TABLES.get(key) or _registry_names(key) or _literals(tp)
        shown = "section" if sub is not None and value is not None else _show(value)
        yield Entry(
            key, type_name(tp), shown, allowed, doc, _backends(key, doc), upstream_name(key),
            sub is not None,
        )  # fmt: skip
        if sub is not None:
            yield from iter_entries(sub, f"{key}.", value if value is not None else sub())
        elif (item := _list_item_dataclass(tp)) is not None:
            yield from iter_entries(item, f"{key}[].")


@functools.cache
def entries() -> tuple[Entry, ...]:
    """Every key of the schema (the optional sections `reference`, `critic` and `env` with
    their own defaults as set when the section is given). Cached: the schema is code."""
    return tuple(iter_entries())


def missing_docstrings() -> list[str]:
    """Keys whose field has no docstring (the reference would show them blank)."""
    return [e.key for e in entries() if not e.doc.strip()]


def render_entry(e: Entry, heading: str = "###") -> str:
    """One key's entry in Markdown (the terminal shows the same text)."""
    lines = [f"{heading} `{e.key}`", ""]
    facts = [f"**type** {e.type}", f"**default** `{e.default}`"]
    lines.append(" · ".join(facts) + "  ")
    if e.allowed and not e.type.startswith("one of"):
        lines.append("**allowed** " + ", ".join(f"`{a}`" for a in e.allowed) + "  ")
    lines.append("**backends** " + ", ".join(e.backends) + "  ")
    if e.upstream:
        lines.append(f"**upstream** {e.upstream}  ")
    lines += ["", _escape_html(e.doc) or "(no docstring)", ""]
    return "\n".join(lines)


def _escape_html(text: str) -> str:
    """`<` and `>` outside code spans as entities: Markdown would read `<time>` as a tag."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even pieces lie outside backticks
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


HEADER = """# Configuration reference

<!-- Generated by `asyncrl config docs` from asyncrl/config/schema*.py: do not edit by hand.
     tests/test_config_reference.py fails when this page and the schema disagree. -->

Every key `asyncrl config validate` accepts, in the order of the schema. Write keys in YAML
(`configs/*.yaml`) or as dotted overrides on the command line
(`asyncrl run CONFIG.yaml actor_train.training_args.learning_rate=1e-6`); `asyncrl config
explain KEY` prints one entry on the terminal. Keys ending in `[]` belong to each item of a
list (e.g. `algorithm.rollout_rs[].name`).

- **type**, **default**: as the loader checks them (`null` is YAML's empty value).
  The four worker sections (`actor_train`, `actor_infer`, `reference`, `critic`) share one
  schema; `reference` and `critic` are off (`null`) until given, and show the defaults their
  keys take once the section is given.
- **allowed**: the values the loader or `config validate` accepts for an enumerated key.
- **backends**: the backends named in the key's docstring; otherwise the backends of the
  key's role (`actor_train`: fsdp2_train, megatron_train; `actor_infer`: sglang, hf_infer;
  `reference`: fsdp2_train, megatron_infer, hf_infer; `critic`: fsdp2_train,
  megatron_train, as `config validate` accepts them); `all` for loop-level keys.
- **upstream**: the verl or ROLL key this one corresponds to. verl's actor block pasted under
  `actor:` loads unchanged; a verl key and its ROLL twin are one setting (both given and
  different is an error).
"""


def render_page() -> str:
    """The whole reference page (docs/reference/config.md)."""
    parts = [HEADER]
    for e in entries():
        depth = e.key.replace("[]", "").count(".")
        if e.section:  # a section: its heading and what it holds; its keys follow
            heading = "##" if depth == 0 else "###"
            optional = " Optional: null (off) unless given." if e.default == "null" else ""
            parts.append(f"{heading} `{e.key}`\n\n{_escape_html(e.doc)}{optional}\n")
            continue
        parts.append(render_entry(e))
    return "\n".join(parts).rstrip() + "\n"


def find(key: str) -> Entry:
    """The entry of `key`; a `ConfigError` line with a did-you-mean for an unknown key."""
    known = {e.key: e for e in entries()}
    if key in known:
        return known[key]
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ConfigError(f"unknown key '{key}'{hint}")


def explain(key: str) -> str:
    """`asyncrl config explain KEY`: the key's reference entry as plain text."""
    e = find(key)
    lines = [e.key, f"  type:     {e.type}", f"  default:  {e.default}"]
    if e.allowed and not e.type.startswith("one of"):
        lines.append(f"  allowed:  {', '.join(e.allowed)}")
    lines.append(f"  backends: {', '.join(e.backends)}")
    if e.upstream:
        lines.append(f"  upstream: {e.upstream.replace('`', '')}")
    lines.append("")
    lines += [f"  {line}" if line else "" for line in (e.doc or "(no docstring)").splitlines()]
    return "\n".join(lines)

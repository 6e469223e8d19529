"""The capability matrix's plan, read from the schema (a test-only module).

Every *enumerated* config value is found here, not listed by hand: each `Literal` field of the
schema (walked from `Config`, optional sections included), each name table `config validate`
checks against (estimators, losses, aggregations, KL types, rejection criteria, strategies per
role), every built-in environment and reward, and the loop's toggles (critic, reference,
the KL loss, `async.max_staleness` 0/1/2/auto, `async.max_inflight_tokens` off/on). Each value
is then classified on this machine:

- refused by `config validate` (with its prerequisites set): it promises nothing;
- refused by the start-up check (`asyncrl.preflight.check_machine`): it needs a package or a
  device this machine lacks;
- otherwise it must run: `plan_runs` packs such values greedily into shrunk real-loop runs,
  each a valid config, until every one has run at least once.

So a value added to the schema gets a case the day it is added: it is refused, or it runs.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from asyncrl.config import Config, ConfigError, load_config
from asyncrl.config import schema as schema_mod
from asyncrl.config import validate as names

OFF = "<off>"
TOGGLES = ("env", "critic", "reference", "actor.use_kl_loss", "algorithm.use_kl_in_reward")
ON = "<on>"
#: A token budget of about one batch at its worst case, so it binds: 2 prompts x 3 x (64 + 8)
#: (`tests/test_capability_effects.py`'s base; the matrix's, with 6-token responses, needs 420).
TOKEN_BUDGET = 432
ROLES = ("actor_train", "actor_infer", "reference", "critic")


@dataclass(frozen=True)
class Dimension:
    path: str
    """Dotted config path (or a toggle's name)."""
    values: tuple[Any, ...]
    """Every value the schema enumerates for it."""
    per_run: int = 1
    """Values one run can take at once (list fields, e.g. rejection criteria, take several)."""
    late: bool = False
    """Covered after all other dimensions, in runs of their own (rewards: so the runs that
    cover estimators and losses keep the test's graded reward, whose advantages are non-zero)."""


def _literal_values(tp: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            found = _literal_values(arg)
            if found:
                return found
    return None


def _dataclass_of(tp: Any) -> type | None:
    for arg in (tp, *typing.get_args(tp)):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def literal_fields(cls: type = Config, prefix: str = "") -> Iterator[Dimension]:
    """Every Literal-typed field reachable from `cls` (lists of dataclasses are skipped: their
    enumerations are name tables, below)."""
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))  # its own module
    for f in dataclasses.fields(cls):
        key = schema_mod.FIELD_ALIASES.get(f.name, f.name)
        path = f"{prefix}{key}"
        tp = hints[f.name]
        values = _literal_values(tp)
        if values:
            yield Dimension(path, values)
        elif typing.get_origin(tp) is not list and (sub := _dataclass_of(tp)) is not None:
            yield from literal_fields(sub, f"{path}.")


def dimensions() -> list[Dimension]:
    """All enumerated values, toggles first (later dimensions may need a section on)."""
    from asyncrl.envs.registry import env_names
    from asyncrl.rewards.registry import reward_names

    dims = [
        Dimension("env", (OFF, *env_names())),
        Dimension("critic", (OFF, ON)),
        Dimension("reference", (OFF, ON)),
        Dimension("actor.use_kl_loss", (False, True)),
        Dimension("algorithm.use_kl_in_reward", (False, True)),
        Dimension("async.max_staleness", (0, 1, 2, "auto")),
        Dimension("async.max_inflight_tokens", (0, TOKEN_BUDGET)),
        Dimension("actor_train.model_args.lora_rank", (0, 8)),
        Dimension("actor.use_dynamic_bsz", (False, True)),
        Dimension("actor.share_prompt_forward", (True, False)),
        # FSDP2 over 2 CPU ranks (gloo): fsdp2_train's sharded learner
        Dimension("actor_train.device_mapping", ("[]", "[0,1]")),
        Dimension("algorithm.adv_estimator", names.ADV_ESTIMATORS),
        Dimension("actor.policy_loss.loss_mode", names.LOSS_MODES),
        Dimension("actor.loss_agg_mode", names.LOSS_AGG_MODES),
        Dimension("actor.kl_loss_type", names.KL_TYPES),
        Dimension("algorithm.kl_penalty", names.KL_TYPES),
        Dimension("algorithm.rollout_rs", names.RS_CRITERIA, per_run=6),
        Dimension("rollout.reward_fn", tuple(reward_names()), late=True),
    ]
    dims += [
        Dimension(f"{role}.strategy_args.strategy_name", names.STRATEGIES[role]) for role in ROLES
    ]
    given = {d.path for d in dims}  # auto is max_staleness's Literal, enumerated above
    dims += [d for d in literal_fields() if d.path not in given]

    # The toggles first; then what needs a particular estimator (critic settings: gae; the KL
    # penalty in the reward: reinforce_plus_plus), so they claim it before the estimator
    # dimension spends the run on another one.
    def order(dim: Dimension) -> int:
        if dim.path in TOGGLES:
            return 0
        needs = (requirements(dim.path, v) for v in dim.values)
        estimator = "algorithm.adv_estimator"
        return 1 if dim.path != estimator and any(estimator in n for n in needs) else 2

    return sorted(dims, key=order)


class AnyOf(tuple):
    """A requirement met by any of these values (the first is taken when none is set)."""


# What a value needs around it to be meaningful: the (dimension, value) pairs set with it.
CRITIC = {"critic": ON, "algorithm.adv_estimator": "gae"}  # each needs the other
# KL-in-reward needs an estimator the learner computes (a set: any of them will do).
KL_IN_REWARD = {
    "algorithm.use_kl_in_reward": True,
    "algorithm.adv_estimator": AnyOf(
        ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")
    ),
}


def requirements(path: str, value: Any) -> dict[str, Any]:
    section = path.split(".", 1)[0]
    if section == "env" and path != "env":
        return {"env": "guess_number"}
    if path == "rollout.reward_fn":
        return {"env": OFF}  # an environment's episodes carry their own rewards
    if section == "critic" and (path != "critic" or value == ON) or value == "gae":
        return CRITIC
    if path.startswith(("algorithm.kl_ctrl.", "algorithm.kl_penalty")):
        return KL_IN_REWARD
    if path == "algorithm.use_kl_in_reward" and value:
        return KL_IN_REWARD
    if path.startswith("weight_sync.lora_sync") and value != "auto":
        return {"actor_train.model_args.lora_rank": 8}
    if path == "actor.profiler.tool" and value == "torch":  # a trace of step 1
        return {"actor.profiler.enable": True, "actor.profiler.steps": "[1]"}
    if path == "async.max_staleness" and value == "auto":  # steers by the IS weights' ESS
        return {"algorithm.correction_mode": "decoupled"}
    if path == "async.max_inflight_tokens" and value:  # sized for single-turn responses
        return {"env": OFF}
    if path == "async.stale_policy" and value == "correct":  # IS that corrects a whole response
        return {"algorithm.rollout_is_level": AnyOf(("geometric", "sequence"))}
    if section == "reference" and path != "reference":
        return {"reference": ON, "actor.use_kl_loss": True}
    if path == "reference" and value == ON or path == "actor.kl_loss_type":
        return {"actor.use_kl_loss": True}
    return {}


def classify(
    dims: list[Dimension], to_overrides: Callable[[dict[str, Any]], list[str]]
) -> dict[str, dict[Any, str]]:
    """path -> value -> "refused: <line>" | "not here: <line>" | "runs"."""
    from asyncrl.preflight import check_machine

    out: dict[str, dict[Any, str]] = {}
    for dim in dims:
        for value in dim.values:
            one = (value,) if dim.per_run > 1 else value
            choice = requirements(dim.path, value) | {dim.path: one}
            try:
                cfg = load_config(None, to_overrides(choice))
            except ConfigError as e:
                out.setdefault(dim.path, {})[value] = f"refused: {e}"
                continue
            try:
                check_machine(cfg)
            except Exception as e:  # noqa: BLE001 - MissingPieceError or DeviceError
                out.setdefault(dim.path, {})[value] = f"not here: {type(e).__name__}: {e}"
                continue
            out.setdefault(dim.path, {})[value] = "runs"
    return out


def _with_requirements(choice: dict[str, Any], needs: dict[str, Any]) -> dict[str, Any] | None:
    """`choice` plus what a value needs, or None when the run already chose otherwise. An
    environment requirement is met by any environment."""
    out = dict(choice)
    for path, want in needs.items():
        have = choice.get(path)
        if have is None:
            out[path] = want[0] if isinstance(want, AnyOf) else want
        elif isinstance(want, AnyOf):
            if have not in want:
                return None
        elif have != want and not (path == "env" and OFF not in (have, want)):
            return None
    return out


def valid(choice: dict[str, Any], to_overrides: Callable[[dict[str, Any]], list[str]]) -> bool:
    try:
        load_config(None, to_overrides(choice))
    except ConfigError:
        return False
    return True


def plan_runs(
    dims: list[Dimension],
    classes: dict[str, dict[Any, str]],
    to_overrides: Callable[[dict[str, Any]], list[str]],
) -> list[dict[str, Any]]:
    """Greedy cover: each run takes, dimension by dimension, the next value that has not run
    yet and keeps the config valid, until every runnable value is in some run."""
    runnable = {(d.path, v) for d in dims for v in d.values if classes[d.path][v] == "runs"}
    runs: list[dict[str, Any]] = []
    for late in (False, True):
        phase = [d for d in dims if d.late == late]
        todo = {(d.path, v) for d in phase for v in d.values} & runnable
        while todo:
            choice = _one_run(phase, todo, to_overrides)
            covered = {
                (p, v) for p, chosen in choice.items()
                for v in (chosen if isinstance(chosen, tuple) else (chosen,))
            }  # fmt: skip
            if not covered & todo:
                raise AssertionError(
                    f"values that validate but fit no run: {sorted(todo, key=str)}"
                )
            todo -= covered
            runs.append(choice)
    return runs


def _one_run(
    dims: list[Dimension],
    todo: set[tuple[str, Any]],
    to_overrides: Callable[[dict[str, Any]], list[str]],
) -> dict[str, Any]:
    choice: dict[str, Any] = {}
    for dim in dims:
        if dim.per_run == 1 and dim.path in choice:
            continue  # set already, as a value's requirement
        for value in [v for v in dim.values if (dim.path, v) in todo]:
            trial = _with_requirements(choice, requirements(dim.path, value))
            if trial is None:
                continue  # this run has its section off, or on otherwise
            if dim.per_run > 1:
                taken = (*choice.get(dim.path, ()), value)
                if len(taken) <= dim.per_run and valid(trial | {dim.path: taken}, to_overrides):
                    choice = trial | {dim.path: taken}
                continue
            if valid(trial | {dim.path: value}, to_overrides):
                choice = trial | {dim.path: value}
                break
    return choice

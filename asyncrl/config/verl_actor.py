"""verl's actor block pasted under `actor:`, made to mean in asyncrl what it meant in verl.

Three steps, none of which evaluates anything:
- `prepare_actor` (on the raw YAML, before it is typed): OmegaConf interpolations are resolved
  by their form only: `${oc.select:path,default}` becomes its default (the path names a verl
  section asyncrl does not have; no default: null) and `${.key}` the value of the sibling `key`;
  any other `${...}` is one error line. Keys asyncrl has no use for are dropped with ONE warning
  line listing them, but only while their value changes nothing (`freeze_vision_tower: true` is
  refused with its reason). `???` (verl's "must be set") is fine on a dropped key and one error
  line on a key asyncrl reads.
- `fold_actor` (on the typed config): verl's optimizer and micro-batch keys have ROLL twins in
  `actor_train.training_args`; the rule: neither given, ROLL's default; one given, it wins; both
  given and different, one error line naming both. The effective value is written into
  training_args, which every backend reads.
- `check_actor` (validation): the two sides agree (a config built in code), and the profiler,
  torch.compile and verl value ranges are ones a run honours.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import sys
from typing import Any

import yaml

from asyncrl.config.rules import TORCH_COMPILE_STRATEGIES, positive, within
from asyncrl.config.schema import Config, ConfigError, TrainingArgs

MISSING = "???"
_SELECT = re.compile(r"^\$\{oc\.select:([^,{}]+)(?:,(.*))?\}$", re.DOTALL)
_SIBLING = re.compile(r"^\$\{\.([A-Za-z_]\w*)\}$")
# Keys asyncrl has no use for: key -> (values that change nothing, why any other is refused).
# `_target_` (a verl dataclass path) is dropped at every depth.
IGNORED: dict[str, tuple[tuple[Any, ...], str]] = {
    "freeze_vision_tower": (
        (False, None),
        "asyncrl trains text-only causal LMs: there is no vision tower to freeze",
    ),
    "use_fused_kernels": (
        (False, None),
        "asyncrl has no fused-kernel path; pick the attention kernel with "
        "actor_train.model_args.attn_implementation",
    ),
    "use_remove_padding": (
        (False, None),
        "the fsdp2_train learner drops padding with actor.use_dynamic_bsz: true",
    ),
    "ulysses_sequence_parallel_size": (
        (1, None),
        "fsdp2_train has no Ulysses sequence parallelism; megatron_train splits sequences "
        "with context_parallel_size in strategy_config",
    ),
}
# verl's `strategy` (its backend) -> asyncrl's actor_train.strategy_args.strategy_name.
VERL_STRATEGIES = {"fsdp": "fsdp2_train", "fsdp2": "fsdp2_train", "megatron": "megatron_train"}
# verl key (under actor) -> its ROLL twin (under actor_train.training_args).
TWINS = {
    "optim.lr": "learning_rate",
    "optim.weight_decay": "weight_decay",
    "optim.lr_warmup_steps": "warmup_steps",
    "optim.lr_scheduler_type": "lr_scheduler_type",
    "optim.clip_grad": "max_grad_norm",
    "ppo_micro_batch_size_per_gpu": "per_device_train_batch_size",
}


def warn(line: str) -> None:
    """One warning line on stderr (the CLI's channel for config warnings)."""
    print(f"asyncrl: warning: {line}", file=sys.stderr)


# -- raw YAML ------------------------------------------------------------------------------
def prepare_actor(raw: dict[str, Any]) -> None:
    """Resolve interpolations, drop ignored keys (one warning line), refuse `???` on read keys;
    in place on `raw["actor"]`."""
    actor = raw.get("actor")
    if not isinstance(actor, dict):
        return
    _resolve(actor, "actor")
    train_strategy = _dig(raw, "actor_train", "strategy_args", "strategy_name") or "fsdp2_train"
    dropped = _check_strategy(actor, train_strategy)
    dropped += _drop_ignored(actor, "actor")
    _refuse_missing(actor, "actor")
    targets = [d for d in dropped if d.endswith("._target_")]
    named = [d for d in dropped if d not in targets]
    if targets:  # one per verl dataclass: named once, not once per block
        named.append(f"_target_ ({len(targets)}x, verl class paths)")
    if named:
        warn(f"verl keys asyncrl has no use for, ignored: {', '.join(named)}")


def _dig(node: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def _resolve(node: dict[str, Any] | list[Any], path: str) -> None:
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in list(items):
        sub = f"{path}.{key}" if isinstance(node, dict) else f"{path}[{key}]"
        if isinstance(value, str) and "${" in value:
            siblings = node if isinstance(node, dict) else {}
            node[key] = _interpolate(value, siblings, sub, 0)
        elif isinstance(value, dict | list):
            _resolve(value, sub)


def _interpolate(value: str, siblings: dict[str, Any], path: str, depth: int) -> Any:
    if depth > 8:
        raise ConfigError(f"{path}: interpolations nest too deep (a cycle?)")
    text = value.strip()
    if m := _SELECT.match(text):
        default = m.group(2)
        if default is None:
            return None
        try:
            out = yaml.safe_load(default.strip()) if default.strip() else None
        except yaml.YAMLError:
            out = default.strip()
    elif m := _SIBLING.match(text):
        if m.group(1) not in siblings:
            raise ConfigError(f"{path}: {value!r} names no key {m.group(1)!r} beside it")
        out = copy.deepcopy(siblings[m.group(1)])
    else:
        raise ConfigError(
            f"{path}: interpolation {value!r} is not supported (asyncrl reads "
            "${oc.select:path,default} as its default and ${.key} as a sibling); write the value"
        )
    if isinstance(out, str) and "${" in out:
        return _interpolate(out, siblings, path, depth + 1)
    return out


def _check_strategy(actor: dict[str, Any], train_strategy: str) -> list[str]:
    """verl's `strategy` must name actor_train's backend; `???`/null is dropped."""
    if "strategy" not in actor:
        return []
    value = actor.pop("strategy")
    if value in (MISSING, None):
        return ["actor.strategy"]
    wanted = VERL_STRATEGIES.get(str(value))
    if wanted is None:
        raise ConfigError(
            f"actor.strategy: {value!r} is not one of {', '.join(VERL_STRATEGIES)} (verl's "
            "backend names; asyncrl's is actor_train.strategy_args.strategy_name)"
        )
    if wanted != train_strategy:
        raise ConfigError(
            f"actor.strategy: {value!r} means {wanted}, but actor_train.strategy_args."
            f"strategy_name is {train_strategy!r}; set one backend"
        )
    return []


def _drop_ignored(node: dict[str, Any], path: str) -> list[str]:
    dropped: list[str] = []
    for key in list(node):
        sub = f"{path}.{key}"
        if key == "_target_":
            dropped.append(sub)
            del node[key]
        elif key in IGNORED:
            harmless, reason = IGNORED[key]
            if node[key] != MISSING and node[key] not in harmless:
                raise ConfigError(f"{sub}: {node[key]!r} is not supported: {reason}")
            dropped.append(sub)
            del node[key]
        elif isinstance(node[key], dict):
            dropped += _drop_ignored(node[key], sub)
    return dropped


def _refuse_missing(node: Any, path: str) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            _refuse_missing(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _refuse_missing(value, f"{path}[{i}]")
    elif node == MISSING:
        raise ConfigError(f"{path}: '???' (verl's must-be-set marker) needs a value")


# -- typed config ----------------------------------------------------------------------------
def fold_actor(cfg: Config, raw: dict[str, Any]) -> Config:
    """`cfg` with verl's optimizer and micro-batch values joined into
    actor_train.training_args by the rule (module docstring); `raw` tells which ROLL keys were
    given."""
    given = _dig(raw, "actor_train", "training_args")
    given = set(given) if isinstance(given, dict) else set()
    if cfg.actor.optim.warmup_style is not None and cfg.actor.optim.lr_scheduler_type is None:
        warn("actor.optim.warmup_style is deprecated (verl): read as lr_scheduler_type")
    cfg = _fold(cfg, _micro_batch(cfg, announce=True), given)  # first: the ratio needs the plan
    return _fold(cfg, verl_values(cfg), given)


def _fold(cfg: Config, values: dict[str, tuple[str, Any]], given: set[str]) -> Config:
    targs = cfg.actor_train.training_args
    updates = {}
    for roll, (verl_key, value) in values.items():
        current = getattr(targs, roll)
        if roll in given and current != value:
            raise ConfigError(
                f"{verl_key} ({value}) and actor_train.training_args.{roll} ({current}) are "
                "both set and differ: they are one setting, keep one"
            )
        updates[roll] = value
    if not updates:
        return cfg
    train = dataclasses.replace(
        cfg.actor_train, training_args=dataclasses.replace(targs, **updates)
    )
    return dataclasses.replace(cfg, actor_train=train)


def _micro_batch(cfg: Config, announce: bool = False) -> dict[str, tuple[str, Any]]:
    """ppo_micro_batch_size_per_gpu, or the deprecated global size over the data-parallel
    ranks (verl divides it by the world size the same way)."""
    actor = cfg.actor
    per_gpu, glob = actor.ppo_micro_batch_size_per_gpu, actor.ppo_micro_batch_size
    if per_gpu is not None and glob is not None:
        raise ConfigError(
            "actor.ppo_micro_batch_size and actor.ppo_micro_batch_size_per_gpu are both set; "
            "keep ppo_micro_batch_size_per_gpu (the global one is deprecated)"
        )
    if glob is None:
        key = "actor.ppo_micro_batch_size_per_gpu"
        return {} if per_gpu is None else {"per_device_train_batch_size": (key, per_gpu)}
    from asyncrl.config.plan import derive_plan

    positive("actor.ppo_micro_batch_size", glob)
    _positive_micro(cfg)
    dp = derive_plan(cfg).data_parallel
    if glob % dp:
        raise ConfigError(
            f"actor.ppo_micro_batch_size ({glob}) is not divisible by the {dp} data-parallel "
            "ranks of actor_train; set actor.ppo_micro_batch_size_per_gpu instead"
        )
    if announce:
        warn(
            f"actor.ppo_micro_batch_size is deprecated (verl): read as "
            f"ppo_micro_batch_size_per_gpu = {glob} / {dp} data-parallel ranks = {glob // dp}"
        )
    return {"per_device_train_batch_size": ("actor.ppo_micro_batch_size", glob // dp)}


def verl_values(cfg: Config) -> dict[str, tuple[str, Any]]:
    """ROLL key -> (verl key, value) for each verl optimizer key that is given."""
    optim = cfg.actor.optim
    out: dict[str, tuple[str, Any]] = {}
    for verl_key, roll in TWINS.items():
        value = getattr(optim, verl_key.removeprefix("optim."), None)
        if verl_key.startswith("optim.") and value is not None:
            out[roll] = (f"actor.{verl_key}", value)
    if optim.warmup_style is not None:
        if optim.lr_scheduler_type is not None:
            raise ConfigError(
                "actor.optim.warmup_style and actor.optim.lr_scheduler_type are both set; "
                "keep lr_scheduler_type (warmup_style is its deprecated name)"
            )
        out["lr_scheduler_type"] = ("actor.optim.warmup_style", optim.warmup_style)
    out.pop("warmup_steps", None)  # verl: 0 or negative means "read the ratio"
    warmup = warmup_steps(cfg)
    if warmup is not None:
        out["warmup_steps"] = warmup
    return out


def warmup_steps(cfg: Config) -> tuple[str, int] | None:
    """verl's warm-up, if given: lr_warmup_steps > 0, else int(ratio × total steps) for a
    ratio > 0 (total: total_training_steps > 0, else the run's optimizer steps)."""
    optim = cfg.actor.optim
    if optim.lr_warmup_steps is not None and optim.lr_warmup_steps > 0:
        return "actor.optim.lr_warmup_steps", optim.lr_warmup_steps
    ratio = optim.lr_warmup_steps_ratio
    if ratio is None or ratio <= 0:
        return None
    within("actor.optim.lr_warmup_steps_ratio", ratio, 0, 1)
    return "actor.optim.lr_warmup_steps_ratio", int(ratio * total_steps(cfg))


def total_steps(cfg: Config) -> int:
    """The schedule horizon: total_training_steps when > 0, else the run's optimizer steps
    (the plan's `schedule_horizon`, what `run.py` passes the learner)."""
    from asyncrl.config.plan import derive_plan

    total = cfg.actor.optim.total_training_steps
    if total is not None and total > 0:
        return total
    _positive_micro(cfg)
    return derive_plan(cfg).schedule_horizon


def _positive_micro(cfg: Config) -> None:
    """The batch plan divides by it: checked before the plan is derived."""
    size = cfg.actor_train.training_args.per_device_train_batch_size
    positive("actor_train.training_args.per_device_train_batch_size", size)


# -- validation ------------------------------------------------------------------------------
def check_actor(cfg: Config) -> None:
    """verl's actor keys: ranges, the two sides of each twin agreeing, profiler, compile."""
    actor, optim = cfg.actor, cfg.actor.optim
    for key in ("ppo_micro_batch_size_per_gpu", "ppo_micro_batch_size"):
        if getattr(actor, key) is not None:
            positive(f"actor.{key}", getattr(actor, key))
    if optim.lr is not None:
        positive("actor.optim.lr", optim.lr)
    for key in ("weight_decay", "clip_grad"):
        if getattr(optim, key) is not None:
            positive(f"actor.optim.{key}", getattr(optim, key), allow_zero=True)
    if optim.lr_warmup_steps_ratio is not None:
        within("actor.optim.lr_warmup_steps_ratio", optim.lr_warmup_steps_ratio, 0, 1)
    if optim.num_cycles not in (None, 0.5):
        raise ConfigError(
            f"actor.optim.num_cycles: {optim.num_cycles} is not supported (asyncrl's cosine "
            "decays over half a cycle: 0.5)"
        )
    _check_twins(cfg)
    _check_profiler(cfg)
    strategy = cfg.actor_train.strategy_args.strategy_name
    if actor.use_torch_compile and strategy not in TORCH_COMPILE_STRATEGIES:
        raise ConfigError(
            f"actor.use_torch_compile: the {strategy} learner does not compile its model "
            "(asyncrl/learner/compile.py is not called there); set it to false"
        )


def _check_twins(cfg: Config) -> None:
    """A config built in code (not through load_config, which folds the twins) must give
    both sides the same value: the learner reads training_args only."""
    targs: TrainingArgs = cfg.actor_train.training_args
    for roll, (verl_key, value) in {**_micro_batch(cfg), **verl_values(cfg)}.items():
        if getattr(targs, roll) != value:
            raise ConfigError(
                f"{verl_key} ({value}) differs from actor_train.training_args.{roll} "
                f"({getattr(targs, roll)}): they are one setting, keep one"
            )


def _check_profiler(cfg: Config) -> None:
    prof = cfg.actor.profiler
    if prof.tool not in (None, "torch"):
        raise ConfigError(
            f"actor.profiler.tool: {prof.tool} is not supported (asyncrl writes torch profiler "
            "traces only: tool: torch)"
        )
    torch_cfg = prof.tool_config.get("torch") or {}
    if not isinstance(torch_cfg, dict):
        raise ConfigError("actor.profiler.tool_config.torch must be a mapping")
    if torch_cfg.get("step_start", 0) not in (0, None) or torch_cfg.get("step_end") is not None:
        raise ConfigError(
            "actor.profiler.tool_config.torch: step_start/step_end (mini-batches inside a step) "
            "are not supported; asyncrl traces whole learner steps (actor.profiler.steps)"
        )
    bad = [r for r in prof.ranks if r != 0]
    if bad:
        raise ConfigError(f"actor.profiler.ranks: {bad} (the traced learner is rank 0 only)")
    if not prof.enable:
        return
    if prof.tool is None or not prof.steps:
        raise ConfigError("actor.profiler.enable needs tool: torch and a non-empty steps list")
    for step in prof.steps:
        within("actor.profiler.steps[]", step, 1, max(1, cfg.max_steps))
    train = cfg.actor_train
    if train.strategy_args.strategy_name != "fsdp2_train" or len(train.device_mapping) > 1:
        raise ConfigError(
            "actor.profiler: traces the learner in the driver process; learners in Ray actors "
            "(megatron_train, or more than one actor_train device) are not traced"
        )
    if prof.save_path is not None and not prof.save_path.strip():
        raise ConfigError("actor.profiler.save_path must name a directory, got an empty string")

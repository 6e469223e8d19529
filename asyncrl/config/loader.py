"""YAML + dotted overrides → a validated `Config`.

Everything is parsed, nothing evaluated: `device_mapping: list(range(0,16))` is matched by a
regular expression. Every problem is one `ConfigError` line naming the key path.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from asyncrl.config.schema import FIELD_ALIASES, Config, ConfigError
from asyncrl.config.validate import validate

# Keys that existed in verl/asyncrl once and were removed: path suffix -> migration hint.
REMOVED_KEYS: dict[str, str] = {
    "tis_imp_ratio_cap": (
        "was removed; use algorithm.rollout_is_threshold (same value), "
        "algorithm.rollout_is: true, algorithm.rollout_is_level: token, "
        "algorithm.rollout_is_mode: truncate"
    ),
}
_RANGE = re.compile(
    r"^\s*list\(\s*range\(\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?(?:,\s*(-?\d+)\s*)?\)\s*\)\s*$"
)
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or start from the defaults), apply `a.b.c=value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    for item in overrides or []:
        apply_override(raw, item)
    _reject_removed_keys(raw, "")
    cfg = build(Config, raw, "", Config())
    validate(cfg)
    return cfg


def _reject_removed_keys(node: Any, path: str) -> None:
    """Removed keys fail with their migration wherever they sit (verl nests them deeper)."""
    if isinstance(node, dict):
        for key, value in node.items():
            sub = f"{path}.{key}" if path else str(key)
            if key in REMOVED_KEYS:
                raise ConfigError(f"{sub} {REMOVED_KEYS[key]}")
            _reject_removed_keys(value, sub)


def apply_override(raw: dict[str, Any], item: str) -> None:
    """`actor_train.training_args.learning_rate=1e-6` → nested dict assignment (YAML-typed)."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like key.path=value")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


def build(cls: type, data: Any, path: str, base: Any = None) -> Any:
    """Construct dataclass `cls` from a mapping, checking keys and types recursively.

    Keys not given keep the value of `base` (the field's default instance), so a partial
    `actor_infer:` section keeps actor_infer's own defaults rather than WorkerConfig's."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or '<root>'}: expected a mapping, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    by_key = {FIELD_ALIASES.get(f.name, f.name): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in by_key:
            close = difflib.get_close_matches(str(key), list(by_key), n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown key '{sub}'{hint}")
        fld = by_key[key]
        current = getattr(base, fld.name) if base is not None else None
        kwargs[fld.name] = coerce(hints[fld.name], value, sub, current)
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


def coerce(tp: Any, value: Any, path: str, current: Any = None) -> Any:
    """Check (and gently convert) one value against a type hint."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(arg, value, path, current)
            except ConfigError as e:
                errors.append(e)
        raise (
            errors[0]
            if len(errors) == 1
            else ConfigError(f"{path}: expected {_name(tp)}, got {_kind(value)}")
        )
    if origin is Literal:
        if value not in typing.get_args(tp):
            allowed = ", ".join(str(a) for a in typing.get_args(tp))
            raise ConfigError(f"{path}: {value!r} is not one of {allowed}")
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, current if isinstance(current, tp) else tp())
    if origin is list:
        return _coerce_list(tp, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {_kind(value)}")
        return dict(value)
    return _coerce_scalar(tp, value, path)


def _coerce_list(tp: Any, value: Any, path: str) -> list[Any]:
    (item_tp,) = typing.get_args(tp)
    if isinstance(value, str) and item_tp is int:
        value = parse_int_list(value, path)
    elif isinstance(value, str) and item_tp is str:
        value = [value]
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{path}: expected a list, got {_kind(value)}")
    return [coerce(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]


def _coerce_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is Any:
        return value
    if tp is float and isinstance(value, str) and _FLOAT.match(value.strip()):
        return float(value)  # YAML 1.1 reads `1e-6` as a string; accept it for float fields
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (
        tp in (int, float, str, bool)
        and isinstance(value, tp)
        and not (tp is int and isinstance(value, bool))
    ):
        return value
    raise ConfigError(f"{path}: expected {_name(tp)}, got {_kind(value)} {value!r}")


def parse_int_list(text: str, path: str) -> list[int]:
    """`list(range(0,16))`, `range(0,16,2)`, `0,1,2` or `[0, 1]` — parsed, never evaluated."""
    text = text.strip()
    m = _RANGE.match(text if text.startswith("list") else f"list({text})")
    if m:
        a, b, step = m.groups()
        start, stop = (0, int(a)) if b is None else (int(a), int(b))
        return list(range(start, stop, int(step) if step else 1))
    parts = [p.strip() for p in text.strip("[]").split(",") if p.strip()]
    if parts and all(re.fullmatch(r"-?\d+", p) for p in parts):
        return [int(p) for p in parts]
    raise ConfigError(
        f"{path}: cannot parse {text!r} as a device list (use list(range(a,b)) or 0,1,2)"
    )


def _name(tp: Any) -> str:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_name(a) for a in typing.get_args(tp))
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def to_dict(cfg: Any) -> Any:
    """A plain mapping with YAML keys (the inverse of `build`)."""
    if dataclasses.is_dataclass(cfg):
        return {
            FIELD_ALIASES.get(f.name, f.name): to_dict(getattr(cfg, f.name))
            for f in dataclasses.fields(cfg)
        }
    if isinstance(cfg, list):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg

"""YAML + dotted overrides → a validated `Config`.

Everything is parsed, nothing evaluated: `device_mapping: list(range(0,16))` is matched by a
regular expression and its length checked before it is expanded. A key given twice in one
mapping is an error (plain YAML keeps the last silently). Every problem is one `ConfigError`
line naming the key path, or the file and line.
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
from asyncrl.config.strategy_keys import fold_verl_names
from asyncrl.config.validate import MAX_DEVICES, validate
from asyncrl.config.verl_actor import fold_actor, prepare_actor

# Keys that existed in verl/asyncrl once and were removed: path suffix -> migration hint.
REMOVED_KEYS: dict[str, str] = {
    "tis_imp_ratio_cap": (
        "was removed; use algorithm.rollout_is_threshold (same value), "
        "algorithm.rollout_is: true, algorithm.rollout_is_level: token, "
        "algorithm.rollout_is_mode: truncate"
    ),
}
# Numbers of at most 18 digits: int() of them is cheap, and they fit a 64-bit integer.
_INT = r"-?\d{1,18}"
_RANGE = re.compile(
    rf"^\s*list\(\s*range\(\s*({_INT})\s*(?:,\s*({_INT})\s*)?(?:,\s*({_INT})\s*)?\)\s*\)\s*$"
)
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *base` merges; keys written next to it override the merged ones
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: the base constructor names it
            continue
        if first is not None:
            raise ConfigError(f"line {line}: duplicate key {key!r} (first on line {first})")
        seen[key] = line
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def parse_yaml(text: str) -> Any:
    """YAML text → Python objects (safe tags only; duplicate keys refused)."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except ConfigError:
        raise
    except ValueError as e:  # PyYAML's int(): Python refuses numbers of over 4300 digits
        raise ConfigError(f"unreadable value: {str(e).split(';')[0]}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or start from the defaults), apply `a.b.c=value` overrides, validate."""
    raw: dict[str, Any] = {} if path is None else _read_yaml(Path(path))
    for item in overrides or []:
        apply_override(raw, item)
    _reject_removed_keys(raw, "")
    prepare_actor(raw)  # verl's interpolations, `???` and keys asyncrl has no use for
    cfg = fold_actor(build(Config, raw, "", Config()), raw)  # verl's keys meet their ROLL twins
    fold_verl_names(cfg)  # verl's fsdp_config names in strategy_config, as asyncrl's
    validate(cfg)
    return cfg


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"{path}: line {line}: not UTF-8 text (byte 0x{data[e.start]:02x})"
        ) from None
    try:
        raw = parse_yaml(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML{_where(e)}") from None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    return raw


def _where(e: yaml.YAMLError) -> str:
    """`: line 3, column 5: expected ...` from a marked YAML error (its first line otherwise)."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or not problem:
        return f": {(str(e).splitlines() or [type(e).__name__])[0]}"
    return f": line {mark.line + 1}, column {mark.column + 1}: {problem}"


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
        raise ConfigError(f"override {_short(item)} must look like key.path=value")
    try:
        value = parse_yaml(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    except ConfigError as e:
        raise ConfigError(f"override {_short(item)}: {e}") from None
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
    """`list(range(0,16))`, `range(0,16,2)`, `0,1,2` or `[0, 1]` — parsed, never evaluated; a
    range is measured before it is expanded (at most `MAX_DEVICES` items)."""
    text = text.strip()
    m = _RANGE.match(text if text.startswith("list") else f"list({text})")
    if m:
        a, b, step = m.groups()
        start, stop = (0, int(a)) if b is None else (int(a), int(b))
        if step is not None and int(step) == 0:
            raise ConfigError(f"{path}: {text!r} has a range step of 0")
        devices = range(start, stop, int(step) if step else 1)  # lazy: len() costs nothing
        if len(devices) > MAX_DEVICES:
            raise ConfigError(
                f"{path}: {text!r} names {len(devices)} devices, more than {MAX_DEVICES}"
            )
        return list(devices)
    parts = [p.strip() for p in text.strip("[]").split(",") if p.strip()]
    if parts and all(re.fullmatch(_INT, p) for p in parts):
        return [int(p) for p in parts]
    raise ConfigError(
        f"{path}: cannot parse {text!r} as a device list (use list(range(a,b)) or 0,1,2)"
    )


def _short(text: str, limit: int = 80) -> str:
    """`text` quoted, cut to `limit` characters: an error line stays one readable line."""
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _name(tp: Any) -> str:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is Literal:  # the values, not the word "Literal"
        return " or ".join(repr(a) for a in typing.get_args(tp))
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

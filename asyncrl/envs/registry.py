"""Environment lookup by registry name or by a `package.module:Class` path (imported, never
eval'd). Every environment is constructed from its own sub-config: `cls(**env.config)`.

The built-in table maps names to import paths, so listing the names (config validation) imports
no environment code, and gymnasium is imported only by the environments that use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from asyncrl.envs.base import Env, EnvError

BUILTIN_ENVS: dict[str, str] = {
    "frozenlake": "asyncrl.envs.frozenlake:FrozenLakeEnv",
    "sokoban": "asyncrl.envs.sokoban:SokobanEnv",
    "guess_number": "asyncrl.envs.guess_number:GuessNumberEnv",
    "math_tool": "asyncrl.envs.math_tool:MathToolEnv",
    "gym": "asyncrl.envs.gym_adapter:GymTextEnv",
}


def env_names() -> list[str]:
    return sorted(BUILTIN_ENVS)


def is_dotted_path(name: str) -> bool:
    module, sep, attr = name.partition(":")
    return bool(sep and attr and module) and all(p.isidentifier() for p in module.split("."))


def resolve_env(name: str) -> Callable[..., Env]:
    """The environment class (or factory) named by `name`."""
    path = BUILTIN_ENVS.get(name, name)
    if ":" not in path:
        raise EnvError(
            f"unknown env {name!r}; valid names: {', '.join(env_names())} "
            "(or a 'package.module:Class' path)"
        )
    if not is_dotted_path(path):
        raise EnvError(f"env {name!r}: a dotted path must look like 'package.module:Class'")
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvError(f"env {name!r}: cannot import module {module_name!r} ({e})") from None
    cls = getattr(module, attr, None)
    if cls is None or not callable(cls):
        raise EnvError(f"env {name!r}: module {module_name!r} has no callable {attr!r}")
    return cls


def make_env(name: str, config: Mapping[str, Any] | None = None) -> Env:
    """A fresh environment instance for one episode, built from its own sub-config."""
    cls = resolve_env(name)
    config = dict(config or {})
    try:
        env = cls(**config)
    except TypeError as e:
        raise EnvError(f"env {name!r}: bad config {sorted(config)}: {e}") from None
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise EnvError(f"env {name!r}: {type(env).__name__} has no reset(seed) and step(action)")
    return env

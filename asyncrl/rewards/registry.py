"""Reward lookup by name or by a ``package.module:function`` path (imported, never eval'd)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from asyncrl.rewards.base import RewardError, RewardFn


def builtin_rewards() -> dict[str, Callable[[], RewardFn]]:
    """Name -> factory. Built on every call, so no caller can mutate a shared registry;
    factories defer optional imports until the reward is actually asked for."""
    from asyncrl.rewards.arithmetic import arithmetic_exact, arithmetic_partial, format_integer
    from asyncrl.rewards.mathverify import make_math_verify

    return {
        "arithmetic_exact": lambda: arithmetic_exact,
        "arithmetic_partial": lambda: arithmetic_partial,
        "format_integer": lambda: format_integer,
        "math_verify": make_math_verify,
    }


def reward_names() -> list[str]:
    return sorted(builtin_rewards())


def _import_path(spec: str) -> RewardFn:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RewardError(
            f"reward {spec!r}: a dotted path must look like 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - user code: a SyntaxError or its own error too
        first = (str(exc).strip().splitlines() or [""])[0]
        raise RewardError(
            f"reward {spec!r}: cannot import module {module_name!r} ({type(exc).__name__}: {first})"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: {attr!r} is not callable")
    return fn


def _unknown(name: str, names: list[str]) -> RewardError:
    return RewardError(
        f"unknown reward {name!r}; valid names: {', '.join(sorted(names))} "
        "(or a 'package.module:function' path)"
    )


def check_reward(name: str) -> None:
    """Raise `RewardError` unless `name` resolves: a built-in name, or a 'module:function' path
    that imports to a callable. A built-in's optional package is checked only when the reward
    is built (`get_reward_fn`), so a config naming `math_verify` validates on any machine."""
    if ":" in name:
        _import_path(name)
    elif name not in builtin_rewards():
        raise _unknown(name, reward_names())


def get_reward_fn(name: str) -> RewardFn:
    """A built-in reward by name, or any ``module:function`` taking (prompt, response, metadata)."""
    if ":" in name:
        return _import_path(name)
    factories = builtin_rewards()
    if name not in factories:
        raise _unknown(name, list(factories))
    return factories[name]()

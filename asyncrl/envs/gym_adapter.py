"""Any text-renderable gymnasium environment with a discrete action space, as an `Env`.

The model's turn is mapped to an action by name (`action_names`, matched as whole words,
case-insensitive, the earliest mention wins) or by index (the first integer in range). The state
is shown as the environment's `ansi` rendering (colour codes stripped) unless a renderer is
given (a `package.module:function` path taking `(env, observation) -> str`). An unparseable
turn is answered with the list of valid actions and costs `invalid_action_reward`; it does not
advance the gymnasium environment.

Success (`info["solved"]`, what held-out evaluation counts): a step that terminates the episode
(not a time-limit truncation) with a reward of at least `success_reward`; with `success_reward`
null, gymnasium's own `info["is_success"]` where the environment reports one, else never.

Config example: `env: {name: gym, config: {env_id: CliffWalking-v1, action_names: [up, right,
down, left]}}`.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.envs.base import EnvError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_INT = re.compile(r"-?\d+")


def parse_action(text: str, names: Sequence[str], n: int) -> int | None:
    """The action index the text names (earliest whole-word name, else first integer < n)."""
    lowered = text.lower()
    best: tuple[int, int] | None = None
    for index, name in enumerate(names):
        m = re.search(rf"\b{re.escape(name.lower())}\b", lowered)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), index)
    if best is not None:
        return best[1]
    m = _INT.search(text)
    if m and 0 <= int(m.group()) < n:
        return int(m.group())
    return None


def _import_renderer(path: str) -> Callable[[Any, Any], str]:
    module, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr, None) if attr else None
    except ImportError as e:
        raise EnvError(f"gym renderer {path!r}: cannot import ({e})") from None
    if not callable(fn):
        raise EnvError(f"gym renderer {path!r} must be a 'package.module:function' path")
    return fn


class GymTextEnv:
    """A gymnasium environment behind the text `Env` protocol (one instance per episode)."""

    def __init__(
        self,
        env_id: str = "",
        make_kwargs: dict[str, Any] | None = None,
        action_names: Sequence[str] = (),
        instructions: str = "",
        render: str | Callable[[Any, Any], str] | None = None,
        invalid_action_reward: float = 0.0,
        make_fn: Callable[[int], Any] | None = None,
        success_reward: float | None = None,
    ) -> None:
        if not env_id and make_fn is None:
            raise EnvError("gym env needs config.env_id (a gymnasium id such as FrozenLake-v1)")
        self.env_id, self.make_kwargs = env_id, dict(make_kwargs or {})
        self.action_names = [str(a) for a in action_names]
        self.instructions, self.invalid_action_reward = instructions, float(invalid_action_reward)
        self._renderer = _import_renderer(render) if isinstance(render, str) else render
        self._make_fn = make_fn or self._make
        self.success_reward = None if success_reward is None else float(success_reward)
        self.env: Any = None

    def _make(self, seed: int) -> Any:
        import gymnasium

        kwargs = dict(self.make_kwargs)
        if self._renderer is None:
            kwargs.setdefault("render_mode", "ansi")
        try:
            return gymnasium.make(self.env_id, **kwargs)
        except Exception as e:  # noqa: BLE001 - unknown id, bad kwargs: one line for the user
            raise EnvError(f"gymnasium.make({self.env_id!r}) failed: {e}") from None

    @property
    def num_actions(self) -> int:
        space = self.env.action_space
        if not hasattr(space, "n"):
            raise EnvError(f"gym env {self.env_id!r}: only Discrete action spaces are supported")
        return int(space.n)

    def render(self, obs: Any) -> str:
        if self._renderer is not None:
            return self._renderer(self.env.unwrapped, obs)
        frame = self.env.render()
        text = frame if isinstance(frame, str) else str(obs)
        return _ANSI.sub("", text).strip("\n")

    def action_help(self) -> str:
        if self.action_names:
            return "Actions: " + ", ".join(self.action_names) + "."
        return f"Actions: an integer from 0 to {self.num_actions - 1}."

    def reset(self, seed: int) -> str:
        if self.env is not None:
            self.env.close()
        self.env = self._make_fn(seed)
        obs, _ = self.env.reset(seed=seed)
        self.num_actions  # noqa: B018 - fail at reset on a non-discrete action space
        head = f"{self.instructions}\n" if self.instructions else ""
        return f"{head}{self.render(obs)}\n{self.action_help()}"

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.env is None:
            raise EnvError("step before reset")
        action = parse_action(action_text, self.action_names, self.num_actions)
        if action is None:
            return (
                f"Invalid action. {self.action_help()}",
                self.invalid_action_reward,
                False,
                {"invalid_action": True},
            )
        obs, reward, terminated, truncated, info = self.env.step(action)
        done = bool(terminated or truncated)
        solved = self._solved(bool(terminated), float(reward), info)
        return self.render(obs), float(reward), done, {"action": action, "solved": solved}

    def _solved(self, terminated: bool, reward: float, info: Any) -> bool:
        """Whether this step reached the episode's goal (see the module docstring)."""
        if self.success_reward is not None:
            return terminated and reward >= self.success_reward
        return isinstance(info, dict) and bool(info.get("is_success", False))

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None

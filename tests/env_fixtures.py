"""Environments for the multi-turn tests (a test-only module, imported by dotted path).

Each is deterministic in its seed. `FlakyEnv` and `HangingEnv` misbehave in exactly one
instance per class (the first one built after `reset_counters()`), whatever the scheduling of
the concurrent episodes, so a test knows how many episodes must fail.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class ScriptedEnv:
    """`turns` steps with fixed observations and reward `reward_per_turn` (tool messages on
    odd turns, to exercise a second role); done at the last step."""

    def __init__(self, turns: int = 3, reward_per_turn: float = 0.5) -> None:
        self.turns, self.reward_per_turn, self.t = turns, reward_per_turn, 0
        self.actions: list[str] = []

    def reset(self, seed: int) -> list[dict[str, str]]:
        self.t = 0
        return [{"role": "system", "content": "sys"}, {"role": "user", "content": f"seed {seed}"}]

    def step(self, action_text: str) -> tuple[Any, float, bool, dict[str, Any]]:
        self.actions.append(action_text)
        self.t += 1
        role = "tool" if self.t % 2 else "user"
        obs = [{"role": role, "content": f"obs {self.t}"}]
        return obs, self.reward_per_turn * self.t, self.t >= self.turns, {}


class _OneBad(ScriptedEnv):
    _lock = threading.Lock()
    built = 0

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        with self._lock:
            self.index = type(self).built
            type(self).built += 1

    @classmethod
    def reset_counters(cls) -> None:
        cls.built = 0


class FlakyEnv(_OneBad):
    def step(self, action_text: str) -> tuple[Any, float, bool, dict[str, Any]]:
        if self.index == 0 and self.t == 1:
            raise RuntimeError("simulated env crash")
        return super().step(action_text)


class HangingEnv(_OneBad):
    hang_s = 3.0

    def step(self, action_text: str) -> tuple[Any, float, bool, dict[str, Any]]:
        if self.index == 0:
            time.sleep(self.hang_s)
        return super().step(action_text)


class AlwaysRaisesEnv(ScriptedEnv):
    def step(self, action_text: str) -> tuple[Any, float, bool, dict[str, Any]]:
        raise ValueError("always broken")


class ResetRaisesEnv(ScriptedEnv):
    def reset(self, seed: int) -> list[dict[str, str]]:
        raise OSError("cannot start")


class NondeterministicEnv(_OneBad):
    def reset(self, seed: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"seed {seed} instance {self.index}"}]


class BadRewardEnv(ScriptedEnv):
    def step(self, action_text: str) -> tuple[Any, float, bool, dict[str, Any]]:
        return "obs", float("nan"), False, {}

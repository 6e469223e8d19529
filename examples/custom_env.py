"""A user-defined environment: reach a target number from a start with `+1`, `-1` or `x2`.

Any class with `reset(seed)` and `step(action_text)` is an environment; its constructor's
keyword arguments are its config. Register it by dotted path in the run config:

    env:
      name: examples.custom_env:NumberWalkEnv
      config: {max_start: 9, max_target: 40}
      max_turns: 6
      max_tokens_per_turn: 6

and run from the repository root (so `examples` is importable by the rollout actors):

    PYTHONPATH=. asyncrl run configs/agentic_guess_number.yaml \
        env.name=examples.custom_env:NumberWalkEnv env.config="{max_target: 40}"
"""

from __future__ import annotations

import random
import re


class NumberWalkEnv:
    MOVES = {"+1": lambda x: x + 1, "-1": lambda x: x - 1, "x2": lambda x: 2 * x}

    def __init__(self, max_start: int = 9, max_target: int = 40, step_penalty: float = 0.05):
        self.max_start, self.max_target, self.step_penalty = max_start, max_target, step_penalty
        self.value = self.target = 0

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)  # the same seed, the same episode (the group shares it)
        self.value = rng.randint(1, self.max_start)
        self.target = rng.randint(self.value + 1, self.max_target)
        return f"Reach {self.target} from {self.value}. Moves: +1, -1, x2."

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        match = re.search(r"\+1|-1|x2", action_text)
        if match is None:
            return "Moves: +1, -1, x2.", -self.step_penalty, False, {"invalid_action": True}
        self.value = self.MOVES[match.group()](self.value)
        if self.value == self.target:
            return f"{self.value}. Done!", 1.0, True, {"solved": True}
        if self.value > 2 * self.max_target:  # hopeless: end the episode early
            return f"{self.value}. Too far.", -1.0, True, {}
        return f"{self.value}.", -self.step_penalty, False, {}

"""Math with a calculator tool: an arithmetic problem per seed; the model may call the calculator
(Hermes `<tool_call>` format) any number of times up to `max_tool_calls`, then answers.

A turn holding a tool call is answered with the tool's `tool` message(s) (reward 0, episode
goes on); a turn without one is the answer: reward `correct_reward` if its first integer equals
the solution. A wrong answer ends the episode unless `max_attempts` allows another try (the model
is then told `incorrect`). Exceeding `max_tool_calls` ends the episode with reward 0.

`describe_tools` puts the Hermes tool description in a system message (what a real chat model
expects); turn it off for very small models whose context cannot hold it.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.envs.base import EnvError, Observation
from asyncrl.envs.tools import calculator_tool, run_tool_calls, tools_prompt
from asyncrl.rewards.arithmetic import parse_first_integer

OPS = ("+", "-", "*")


def make_problem(seed: int, digits: int, ops: tuple[str, ...]) -> tuple[str, int]:
    rng = random.Random(f"math_tool:{seed}")
    a, b, op = rng.randrange(10**digits), rng.randrange(10**digits), rng.choice(ops)
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a}{op}{b}", answer


class MathToolEnv:
    def __init__(
        self,
        digits: int = 3,
        ops: list[str] | tuple[str, ...] = OPS,
        max_tool_calls: int = 2,
        max_attempts: int = 1,
        correct_reward: float = 1.0,
        describe_tools: bool = True,
        prompt: str = "What is {problem}? Use the calculator if it helps.",
    ) -> None:
        if digits < 1 or not ops or any(op not in OPS for op in ops):
            raise EnvError(f"math_tool: digits >= 1 and ops a non-empty subset of {OPS}")
        self.digits, self.ops = int(digits), tuple(ops)
        self.max_tool_calls, self.max_attempts = int(max_tool_calls), int(max_attempts)
        self.correct_reward, self.describe_tools = float(correct_reward), bool(describe_tools)
        self.prompt = prompt
        self.tools = {t.name: t for t in (calculator_tool(),)}
        self.answer: int | None = None
        self.tool_calls = self.attempts = 0

    def reset(self, seed: int) -> Observation:
        problem, self.answer = make_problem(seed, self.digits, self.ops)
        self.tool_calls = self.attempts = 0
        user = {"role": "user", "content": self.prompt.format(problem=problem)}
        if not self.describe_tools:
            return [user]
        return [{"role": "system", "content": tools_prompt(list(self.tools.values()))}, user]

    def step(self, action_text: str) -> tuple[Observation | str, float, bool, dict[str, Any]]:
        if self.answer is None:
            raise EnvError("step before reset")
        replies = run_tool_calls(action_text, self.tools)
        if replies is not None:
            self.tool_calls += len(replies)
            over = self.tool_calls > self.max_tool_calls
            return replies, 0.0, over, {"tool_calls": len(replies), "over_tool_budget": over}
        self.attempts += 1
        correct = parse_first_integer(action_text) == self.answer
        if correct:
            return "correct", self.correct_reward, True, {"solved": True}
        return "incorrect", 0.0, self.attempts >= self.max_attempts, {"solved": False}

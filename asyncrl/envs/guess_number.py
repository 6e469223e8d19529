"""Guess-the-number: the environment holds a secret integer in [low, high], drawn from the seed;
each turn the model answers a number and hears `higher` or `lower`, until it is right or has used
`max_guesses`. Reward `correct_reward` on the right guess, `guess_penalty` subtracted per wrong
guess (so fewer guesses score more when it is non-zero), `invalid_reward` for a turn with no
number in range (it counts as a guess). The feedback texts are configurable and may name the
guess (`higher: "{guess}+?="`), so that a raw-text model sees its own kind of prompt.

Set `invalid_reward` below a wrong guess's score for RL: at 0 an empty or malformed answer
scores like a wrong guess, so a policy that answers an immediate EOS every turn gets the same
return as one still trying, every group's advantages are 0 and nothing moves it out of that
state (issue 18; configs/agentic_guess_number.yaml uses -0.1).

The optimal policy is binary search, a fixed decision tree over the feedback, which makes the
environment learnable by a very small model: the first guess has one best answer, the second
one per feedback word, and so on.
"""

from __future__ import annotations

import random
import re
from typing import Any

from asyncrl.envs.base import EnvError

_INT = re.compile(r"-?\d+")


class GuessNumberEnv:
    def __init__(
        self,
        low: int = 0,
        high: int = 9,
        max_guesses: int = 4,
        correct_reward: float = 1.0,
        guess_penalty: float = 0.0,
        invalid_reward: float = 0.0,
        prompt: str = "Guess my number from {low} to {high}.",
        higher: str = "higher",
        lower: str = "lower",
        invalid: str = "A number from {low} to {high}.",
    ) -> None:
        if high <= low or max_guesses < 1:
            raise EnvError("guess_number: need low < high and max_guesses >= 1")
        self.low, self.high, self.max_guesses = int(low), int(high), int(max_guesses)
        self.correct_reward, self.guess_penalty = float(correct_reward), float(guess_penalty)
        self.invalid_reward = float(invalid_reward)
        self.prompt, self.higher, self.lower, self.invalid = prompt, higher, lower, invalid
        self.secret: int | None = None
        self.guesses = 0

    def reset(self, seed: int) -> str:
        self.secret = random.Random(f"guess:{seed}").randint(self.low, self.high)
        self.guesses = 0
        return self.prompt.format(low=self.low, high=self.high)

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.secret is None:
            raise EnvError("step before reset")
        self.guesses += 1
        out_of_guesses = self.guesses >= self.max_guesses
        m = _INT.search(action_text)
        guess = int(m.group()) if m else None
        info: dict[str, Any] = {"guesses": self.guesses}
        if guess is None or not self.low <= guess <= self.high:
            text = self.invalid.format(low=self.low, high=self.high)
            return text, self.invalid_reward, out_of_guesses, {**info, "invalid_action": True}
        if guess == self.secret:
            return "correct", self.correct_reward, True, {**info, "solved": True}
        hint = (self.higher if guess < self.secret else self.lower).format(guess=guess)
        return hint, 0.0 - self.guess_penalty, out_of_guesses, info

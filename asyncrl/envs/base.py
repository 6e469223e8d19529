"""The environment contract of agentic rollouts.

An `Env` is a text environment for one episode at a time: `reset(seed)` returns the initial
observation, `step(action_text)` takes the model's whole turn as decoded text and returns
`(observation, reward, done, info)`. Observations are chat messages (`[{"role", "content"}]`);
a plain string is accepted and means one user message. The rollout loop owns the tokens: it
templates observation messages itself, so an environment never sees or produces token ids.

Invariants the rollout relies on: `reset(seed)` is deterministic in `seed` (the n episodes of a
group share one initial prompt); an instance serves one episode at a time (the rollout builds
one instance per episode); `info` holds plain values (str, int, float, bool).

The `info` keys the rollout reads (`rollout/multiturn.py`, `Episode.record`): `solved` (True on
the step that reaches the episode's goal: the env's own definition of success, which training
metrics report as `env/solved_frac` and held-out evaluation as its success rate) and
`invalid_action` (True on a turn the env could not parse as an action). Built-ins: guess_number
and math_tool are solved by the right answer, sokoban when every box is on a target, frozenlake
on reaching the goal, gym by `success_reward` or gymnasium's `is_success` (`gym_adapter.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

Message = dict[str, str]
Observation = list[Message]
ROLES = ("system", "user", "assistant", "tool")


class EnvError(ValueError):
    """An environment could not be resolved, configured, or returned something malformed."""


@runtime_checkable
class Env(Protocol):
    """A text environment; `close()` is optional (called when present)."""

    def reset(self, seed: int) -> Observation | str:
        """Start an episode; the same seed gives the same initial observation."""
        ...

    def step(self, action_text: str) -> tuple[Observation | str, float, bool, dict[str, Any]]:
        """Apply the model's turn; (observation, reward, done, info)."""
        ...


def as_messages(obs: Any, where: str = "observation") -> Observation:
    """Normalise an observation to a list of chat messages, or raise EnvError naming the flaw."""
    if isinstance(obs, str):
        return [{"role": "user", "content": obs}]
    if isinstance(obs, Mapping):
        obs = [obs]
    if not isinstance(obs, Sequence) or not obs:
        raise EnvError(f"{where} must be a string or a non-empty list of chat messages")
    out: Observation = []
    for i, m in enumerate(obs):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise EnvError(f"{where}[{i}] must be a message with a role in {ROLES}")
        if not isinstance(m.get("content"), str):
            raise EnvError(f"{where}[{i}].content must be a string")
        out.append({"role": str(m["role"]), "content": m["content"]})
    return out


def check_step(result: Any) -> tuple[Observation, float, bool, dict[str, Any]]:
    """Validate what `step` returned: a 4-tuple with a finite float reward and a bool done."""
    if not isinstance(result, tuple | list) or len(result) != 4:
        raise EnvError("step must return (observation, reward, done, info)")
    obs, reward, done, info = result
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise EnvError(f"step reward {reward!r} is not a number") from None
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise EnvError(f"step reward {reward!r} is not finite")
    info = dict(info) if isinstance(info, Mapping) else {}
    # A done step may return an empty observation: nothing follows it.
    messages = as_messages(obs, "step observation") if not done or obs else []
    return messages, reward, bool(done), info

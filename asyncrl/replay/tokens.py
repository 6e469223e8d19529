"""Admission in tokens: a bound on the tokens a run holds outside the learner.

Counting groups bounds memory only as well as responses are alike in length; with long-tailed
lengths a group budget either over-admits (the engines' KV caches and the buffer fill with
long responses) or starves the learner. `TokenBudget` bounds, in tokens,

    held = in flight (prompts admitted and not delivered: being generated or in transit)
         + buffered (groups delivered into the buffer and not yet trained or dropped).

A group's tokens are its sequences' tokens, the unit both the engines' KV caches and the
learner's batches scale with: ``n · len(prompt) + Σ response lengths`` (`group_tokens`).

- Admission charges a prompt its worst case, known before a token is generated:
  ``n · (len(prompt_ids) + max_response)`` (`estimate`; a prompt with no ids yet, an env seed
  whose prompt the worker templates, is charged `max_prompt`). A continued (aborted and
  resumed) response stays within `max_response`, so the charge covers it too.
- A delivered group's charge is replaced by its real count, which is never more than the
  charge for prompts within `max_prompt` (an env prompt longer than `prompt_length` may
  exceed it: it only lowers the room, never breaks the accounting).
- Its tokens are released when the group is trained (taken), evicted or filtered.

A prompt may start only while the worst case of any prompt still fits:
``held + worst_case ≤ limit``; once admitted it is charged its own estimate (at most the worst
case), so ``held ≤ limit`` holds at every admission. The learner takes `rollout_batch_size`
groups at once, all of them buffered (counted) until taken, so a limit below one batch's worst
case could leave the buffer unable to hold a batch while admission waits for a batch to be
trained: `config validate` refuses it. Pure Python: no groups here, only counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.types import TrajectoryGroup


def group_tokens(group: TrajectoryGroup) -> int:
    """The group's sequence tokens: every response with its prompt (`n · P + Σ R`)."""
    return group.n * len(group.prompt_ids) + group.num_tokens


@dataclass(frozen=True)
class TokenBudget:
    """The token bound's settings: the limit and the shape that sizes a prompt's worst case."""

    limit: int
    """Most tokens held (in flight + buffered, see the module docstring)."""
    group_size: int
    """Responses per prompt (`num_return_sequences_in_group`)."""
    max_prompt: int
    """Longest prompt in tokens (`prompt_length`): the charge of a prompt without ids."""
    max_response: int
    """Most tokens one response may reach (max_new_tokens, or response_length for episodes)."""

    def __post_init__(self) -> None:
        for name in ("limit", "group_size", "max_prompt", "max_response"):
            if getattr(self, name) < 1:
                raise ValueError(f"token budget: {name} must be >= 1, got {getattr(self, name)}")
        if self.limit < self.worst_case():
            raise ValueError(
                f"token budget: limit {self.limit} is below one group's worst case "
                f"{self.worst_case()}: no prompt could ever start"
            )

    def worst_case(self) -> int:
        """The largest charge of any prompt: n · (max_prompt + max_response)."""
        return self.group_size * (self.max_prompt + self.max_response)

    def estimate(self, payload: dict[str, Any]) -> int:
        """A prompt's charge at admission, from its ids (the one field of a payload read)."""
        prompt = len(payload.get("prompt_ids") or ()) or self.max_prompt
        return self.group_size * (prompt + self.max_response)

    def fits(self, held: int) -> int:
        """How many more prompts surely fit when `held` tokens are held (0 or more)."""
        return max(0, (self.limit - held) // self.worst_case())

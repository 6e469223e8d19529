"""Token-level chat templating for multi-turn episodes: the history is never re-tokenized.

An episode's token ids grow by appending, turn after turn, the engine's generated ids exactly as
returned and the ids of the *new* observation turn only. The observation turn's text is what the
tokenizer's own chat template adds for those messages: rendered after a fixed placeholder
conversation that ends with an assistant message, minus that conversation's rendering (so a
template that injects a default system prompt, as Qwen's does, adds it to the placeholder only).
The assistant turn's closing text (`<|im_end|>\n` for ChatML) is part of the observation ids,
without its EOS token when the model already generated it. So the logprob the engine reported
for every generated token is conditioned on exactly the ids the learner later sees.

`template: none` is the raw alternative for models without a chat format: the prompt is the
initial messages' contents joined by newlines, an observation is its contents joined by
newlines, preceded by the EOS text when the model's turn ended without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncrl.envs.base import EnvError, Message

_PLACEHOLDER = "@@asyncrl-placeholder@@"
_BASE: list[Message] = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": _PLACEHOLDER},
]


class TurnTemplate:
    """Initial prompt ids and per-observation ids for one tokenizer and template mode."""

    def __init__(self, tokenizer: Any, mode: str = "native") -> None:
        if mode not in ("native", "none"):
            raise ValueError(f"template mode must be native or none, got {mode!r}")
        self.tok, self.mode = tokenizer, mode
        self.eos_id = tokenizer.eos_token_id
        self.eos_text = tokenizer.eos_token or ""
        if mode == "native":
            if not getattr(tokenizer, "chat_template", None):
                raise EnvError("env.template: native needs a tokenizer with a chat template")
            self._base_text = self._render(_BASE, generation_prompt=False)
            end = self._base_text.rindex(_PLACEHOLDER) + len(_PLACEHOLDER)
            self.closing = self._base_text[end:]  # e.g. "<|im_end|>\n"

    def _render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            list(messages), add_generation_prompt=generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The initial observation as the model's prompt, ending where the model writes."""
        if self.mode == "none":
            return self.encode("\n".join(m["content"] for m in messages))
        return self.encode(self._render(messages, generation_prompt=True))

    def observation_text(self, messages: Sequence[Message], ended_with_eos: bool) -> str:
        """Text appended after a model turn: its closing, the observation turn, the next
        assistant header."""
        if self.mode == "none":
            head = "" if ended_with_eos else self.eos_text
            return head + "\n".join(m["content"] for m in messages)
        full = self._render([*_BASE, *messages], generation_prompt=True)
        if not full.startswith(self._base_text):
            raise EnvError("the chat template re-renders earlier turns; use env.template: none")
        closing = self.closing
        if ended_with_eos and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text) :]
        return closing + full[len(self._base_text) :]

    def observation_ids(self, messages: Sequence[Message], last_token: int | None) -> list[int]:
        return self.encode(self.observation_text(messages, last_token == self.eos_id))

"""Greedy generation and exact-match accuracy of a causal LM on raw or chat-templated prompts:
what the embedded model's build reports (`tiny.py`, `mix.py`) and the tests measure it with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def render_prompts(tokenizer: Any, prompts: Sequence[str], template: str) -> list[str]:
    """Prompt text as the model sees it: raw (``none``) or wrapped by the chat template."""
    if template in ("none", "raw"):
        return list(prompts)
    if template != "native":
        raise ValueError(f"template must be 'native' or 'none', got {template!r}")
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]


def greedy_responses(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int = 8,
    batch_size: int = 64,
    template: str = "none",
) -> list[str]:
    """Greedy continuations of ``prompts`` (batched, left padding), cut after the first EOS,
    which is kept so the end marker stays visible. The model's train/eval mode and the tokenizer's padding side are
    restored afterwards (the training loop calls this mid-run)."""
    import torch

    was_training, old_side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"  # generation continues from the right edge of every row
    device = next(model.parameters()).device
    responses: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            texts = render_prompts(tokenizer, prompts[start : start + batch_size], template)
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                out = model.generate(
                    input_ids=enc["input_ids"].to(device),
                    attention_mask=enc["attention_mask"].to(device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            for row in out[:, enc["input_ids"].shape[1] :].tolist():
                if tokenizer.eos_token_id in row:  # finished rows are padded after their EOS
                    row = row[: row.index(tokenizer.eos_token_id) + 1]
                responses.append(tokenizer.decode(row))
    finally:
        model.train(was_training)
        tokenizer.padding_side = old_side
    return responses


def evaluate_accuracy(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    max_new_tokens: int = 8,
    batch_size: int = 64,
    template: str = "none",
) -> float:
    """Greedy exact-match accuracy on rows ``{"prompt", "answer"}``, scored by the
    ``arithmetic_exact`` reward so that evaluation and RL agree on what is correct."""
    from asyncrl.rewards.arithmetic import arithmetic_exact

    if not rows:
        raise ValueError("evaluate_accuracy needs at least one row")
    prompts = [r["prompt"] for r in rows]
    texts = greedy_responses(model, tokenizer, prompts, max_new_tokens, batch_size, template)
    return sum(arithmetic_exact(r["prompt"], t, r) for r, t in zip(rows, texts)) / len(rows)

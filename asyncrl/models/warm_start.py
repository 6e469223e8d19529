"""The embedded model's supervised warm-start (`tiny.py` builds the model, then runs it): the
synthetic arithmetic task's train split as (input_ids, labels) examples, raw and chat-templated
in separate batches, with a mix's episodes (`mix.py`) a share of the batches; AdamW with
warm-up and a cosine decay, on one thread."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from asyncrl.data.synthetic import ArithmeticTask, make_rows
from asyncrl.models import mix as mixes
from asyncrl.models.generate import render_prompts
from asyncrl.threads import torch_threads


class WarmStartSpec(Protocol):
    """What the warm-start reads of the model's spec (`tiny.TinyModelSpec`, whose fields say
    what each is); a protocol, so that this module needs nothing of tiny.py, which runs it."""

    task: ArithmeticTask
    train_rows: int
    steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    chat_fraction: float
    estimate_fraction: float
    seed: int
    mix: tuple[str, ...]
    mix_episodes: int
    mix_fraction: float
    mix_batch_size: int


def answer_text(answer: str, estimate: bool) -> str:
    """The warm-start target: the exact answer, or an estimate to the nearest ten (``~360``).

    The warm-start corpus mixes the two styles, as a pretraining mix holds several answer
    styles for the same kind of question. An estimate is wrong for the exact-match verifier
    unless the answer is a multiple of ten, so RL has a behaviour the model already has (the
    exact style) to amplify over one it must unlearn, on top of the arithmetic itself (Zhao et
    al. 2025, "Echo Chamber: RL post-training amplifies behaviors learned in pretraining").
    """
    if not estimate:
        return answer
    value = int(answer)
    return f"~{10 * ((value + 5) // 10)}"


def encode_examples(
    tokenizer: Any, rows: list[dict[str, str]], template: str, estimate_fraction: float, seed: int
) -> list:
    """(input_ids, labels) per row; labels are -100 on the prompt so only the answer is learned."""
    texts = render_prompts(tokenizer, [r["prompt"] for r in rows], template)
    prompt_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    rng = random.Random(f"{seed}:style")  # a row keeps its style in every template
    answers = [answer_text(r["answer"], rng.random() < estimate_fraction) for r in rows]
    answer_ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    examples = []
    for p, a in zip(prompt_ids, answer_ids):
        target = [*a, tokenizer.eos_token_id]
        examples.append((p + target, [-100] * len(p) + target))
    return examples


def collate(batch: list, pad_id: int) -> dict[str, Any]:
    """Right-padded tensors of (input_ids, labels) examples, with their attention mask."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (x, y) in enumerate(batch):  # right padding: positions stay 0..n-1 while training
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def training_batches(spec: WarmStartSpec, pools: dict[str, list], mix_pool: list) -> Iterator[list]:
    """The warm-start's ``spec.steps`` batches: arithmetic (raw or chat-templated), and with a
    mix a ``mix_fraction`` share of mix-episode batches. The mix draws from its own generator,
    so without a mix the arithmetic batches are exactly those of the model before mixes."""
    rng, mix_rng = random.Random(spec.seed), random.Random(f"{spec.seed}:mix-batches")
    for _ in range(spec.steps):
        if mix_pool and mix_rng.random() < spec.mix_fraction:
            yield [mix_pool[mix_rng.randrange(len(mix_pool))] for _ in range(spec.mix_batch_size)]
            continue
        pool = pools["native" if rng.random() < spec.chat_fraction else "none"]
        yield [pool[rng.randrange(len(pool))] for _ in range(spec.batch_size)]


def warm_start(
    model: Any,
    tokenizer: Any,
    spec: WarmStartSpec,
    on_step: Callable[[int, float], None] | None = None,
) -> float:
    """Supervised warm-start on the train split (AdamW, warmup + cosine). Returns final loss.
    `on_step(steps_done, loss)` is called after every optimizer step (progress reporting)."""
    import torch

    rows = make_rows(spec.task, "train", spec.train_rows, spec.seed)
    # Raw and chat-templated examples go in separate batches: mixing them would pad every raw
    # example to the (3x longer) chat length.
    style = (spec.estimate_fraction, spec.seed)
    pools = {"none": encode_examples(tokenizer, rows, "none", *style)}
    if spec.chat_fraction > 0:
        pools["native"] = encode_examples(tokenizer, rows, "native", *style)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    loss = float("nan")
    model.train()
    torch.manual_seed(spec.seed)
    # One thread: at this size a second buys little, and on a busy box (Ray actors, servers)
    # spinning OpenMP threads made steps ~10x slower; it also keeps the result independent of
    # the machine's core count.
    with torch_threads(1):
        batches = training_batches(
            spec, pools, mixes.corpus(tokenizer, spec.mix, spec.mix_episodes, spec.seed)
        )
        for step, batch in enumerate(batches):
            out = model(**collate(batch, tokenizer.pad_token_id))
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            loss = out.loss.item()
            if on_step is not None:
                on_step(step + 1, loss)
    model.eval()
    return loss

"""The embedded default model: a character-level tokenizer and a tiny Qwen2 causal LM, given a
short supervised warm-start on the synthetic arithmetic task so that RL starts with signal.

The task format: prompt ``12+345=`` (raw) or the chat-templated user message; the response is
the answer digits followed by ``<|im_end|>`` (the EOS token). Everything is built locally, no hub.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncrl.data.synthetic import EMBEDDED_TASK, ArithmeticTask, make_rows
from asyncrl.device import torch_threads
from asyncrl.logs import StepProgress

# Bump when a change here alters what gets built: it is part of the cache key.
CODE_VERSION = 1
PAD, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END, UNK)
MARKER = "asyncrl_embedded.json"  # written last: its presence means the directory is complete
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the built model; its hash names the cache directory."""

    task: ArithmeticTask = EMBEDDED_TASK
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 512
    train_rows: int = 12_000
    heldout_rows: int = 500
    steps: int = 2000
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 50
    chat_fraction: float = 0.1  # share of warm-start batches rendered with the chat template
    # Share of warm-start answers written as an estimate, ``~360`` for 357 (see `answer_text`).
    estimate_fraction: float = 0.6
    seed: int = 0

    def digest(self) -> str:
        blob = json.dumps({"spec": asdict(self), "code": CODE_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


DEFAULT_SPEC = TinyModelSpec()


def build_tokenizer() -> Any:
    """Character-level tokenizer (printable ASCII + newline + specials) as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    # BPE without merges splits text into single characters; unknown characters become <unk>.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=IM_END,
        unk_token=UNK,
        additional_special_tokens=[IM_START],
        padding_side="left",
        model_max_length=DEFAULT_SPEC.max_position_embeddings,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(spec: TinyModelSpec, tokenizer: Any) -> Any:
    """A randomly initialised tiny Qwen2 causal LM (tied embeddings, fp32)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    return model


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


def _encode_examples(
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


def _collate(batch: list, pad_id: int) -> dict[str, Any]:
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


def warm_start(
    model: Any,
    tokenizer: Any,
    spec: TinyModelSpec,
    on_step: Callable[[int, float], None] | None = None,
) -> float:
    """Supervised warm-start on the train split (AdamW, warmup + cosine). Returns final loss.
    `on_step(steps_done, loss)` is called after every optimizer step (progress reporting)."""
    import torch

    rows = make_rows(spec.task, "train", spec.train_rows, spec.seed)
    # Raw and chat-templated examples go in separate batches: mixing them would pad every raw
    # example to the (3x longer) chat length.
    style = (spec.estimate_fraction, spec.seed)
    pools = {"none": _encode_examples(tokenizer, rows, "none", *style)}
    if spec.chat_fraction > 0:
        pools["native"] = _encode_examples(tokenizer, rows, "native", *style)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    rng, loss = random.Random(spec.seed), float("nan")
    model.train()
    torch.manual_seed(spec.seed)
    # One thread: at this size a second buys little, and on a busy box (Ray actors, servers)
    # spinning OpenMP threads made steps ~10x slower; it also keeps the result independent of
    # the machine's core count.
    with torch_threads(1):
        for step in range(spec.steps):
            pool = pools["native" if rng.random() < spec.chat_fraction else "none"]
            batch = [pool[rng.randrange(len(pool))] for _ in range(spec.batch_size)]
            out = model(**_collate(batch, tokenizer.pad_token_id))
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


def build_embedded_model(
    out_dir: str | Path, spec: TinyModelSpec = DEFAULT_SPEC, progress: bool = False
) -> dict[str, Any]:
    """Build, warm-start and save the model into ``out_dir``; returns the recorded report.
    ``progress`` shows the warm-start's steps, loss and ETA on stderr (it takes minutes)."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    t0, cpu0 = time.perf_counter(), time.process_time()
    tokenizer = build_tokenizer()
    model = build_model(spec, tokenizer)
    if progress:
        with StepProgress(spec.steps, "asyncrl: warm-start") as bar:
            loss = warm_start(model, tokenizer, spec, lambda n, x: bar.update(n, loss=x))
    else:
        loss = warm_start(model, tokenizer, spec)
    train_s, train_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    heldout = make_rows(spec.task, "heldout", spec.heldout_rows, spec.seed)
    report: dict[str, Any] = {
        "spec": asdict(spec),
        "code_version": CODE_VERSION,
        "digest": spec.digest(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "warm_start_seconds": round(train_s, 2),
        "warm_start_cpu_seconds": round(train_cpu_s, 2),  # wall time on a busy box misleads
        "final_train_loss": round(loss, 4),
        "heldout_accuracy": evaluate_accuracy(model, tokenizer, heldout, template="none"),
    }
    if spec.chat_fraction > 0:
        report["heldout_accuracy_chat"] = evaluate_accuracy(
            model, tokenizer, heldout, template="native"
        )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / MARKER).write_text(json.dumps(report, indent=2) + "\n")
    return report


def default_cache_dir() -> Path:
    """``$ASYNCRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/asyncrl``, else ``~/.cache/asyncrl``."""
    if os.environ.get("ASYNCRL_CACHE_DIR"):
        return Path(os.environ["ASYNCRL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "asyncrl"


def ensure_embedded_model(
    cache_dir: str | Path | None = None, spec: TinyModelSpec = DEFAULT_SPEC, verbose: bool = True
) -> Path:
    """The HF model directory of ``spec``, built once under ``cache_dir`` and reused.

    Concurrent callers serialise on a file lock; the build happens in a temporary sibling that
    is renamed into place only when complete, so a reader never sees a half-written model.
    """
    from filelock import FileLock  # a dependency of huggingface_hub, hence of transformers

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"embedded-{spec.digest()}"
    if (final / MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if (final / MARKER).is_file():
            return final  # another process built it while we waited
        if verbose:
            print(
                f"asyncrl: building the embedded model into {final} (once; minutes on a CPU)",
                file=sys.stderr,
            )
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=root))
        try:
            report = build_embedded_model(tmp, spec, progress=verbose)
            if final.exists():  # incomplete leftover (no marker): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(
            f"asyncrl: embedded model ready: warm-start {report['warm_start_seconds']}s, "
            f"held-out greedy accuracy {report['heldout_accuracy']:.1%}",
            file=sys.stderr,
        )
    return final


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m asyncrl.models.tiny [--cache-dir DIR]``: build (once) and print the report."""
    import argparse

    parser = argparse.ArgumentParser(description="Build the embedded tiny model (cached).")
    parser.add_argument("--cache-dir", default=None, help="default: ~/.cache/asyncrl")
    args = parser.parse_args(argv)
    path = ensure_embedded_model(args.cache_dir)
    print(path)
    print((path / MARKER).read_text(), end="")


if __name__ == "__main__":
    main()

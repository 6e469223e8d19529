"""The hf engine's decisions about one request, as pure functions: whether its prompt can be
served, its sampling generator, and after each sampled token whether it has finished (and
why). The engine (engine.py) applies them under its locks."""

from __future__ import annotations

import random

from asyncrl.engine.hf.batch import Seq


def check_prompt(seq: Seq, vocab_size: int, max_context: int) -> None:
    """Raise ValueError naming what is wrong when `seq`'s prompt cannot be served: a token
    outside the vocabulary, an empty prompt, or one that leaves no room in the context."""
    bad = [t for t in seq.prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"input_ids has token {bad[0]} outside vocab [0, {vocab_size})")
    if not seq.prompt:
        raise ValueError("input_ids is empty")
    if len(seq.prompt) >= max_context:
        raise ValueError(f"prompt of {len(seq.prompt)} tokens >= context {max_context}")


def seed_generator(seq: Seq, seeds: random.Random) -> None:
    """A sampled request's own generator: from its `sampling_seed`, else a fresh seed drawn
    from the engine's `seeds` (greedy requests need none)."""
    if seq.params.temperature > 0:
        seed = seq.params.sampling_seed
        seed = seeds.getrandbits(63) if seed is None else seed
        seq.generator = random.Random(seed)


def finish_reason(seq: Seq, token: int, eos_ids: frozenset[int], max_context: int) -> dict | None:
    """Why `seq` ends after `token` (already appended to its output): a stop token (its own, or
    the model's EOS unless `ignore_eos`), `max_new_tokens` reached, or the context full;
    None: it goes on."""
    params = seq.params
    if token in params.stop_token_ids or (token in eos_ids and not params.ignore_eos):
        return {"type": "stop", "matched": token}
    if len(seq.output_ids) >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    if len(seq.prompt) + len(seq.output_ids) >= max_context:
        return {"type": "length", "length": len(seq.output_ids)}
    return None


def describe(e: BaseException | None) -> str:
    """One line for an exception: its type and the first line of its message."""
    if e is None:
        return "stopped"
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__

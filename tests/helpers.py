"""Test helpers shared by several test modules."""

from __future__ import annotations

import time
from pathlib import Path


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    """Poll `condition` (a cheap look at another thread's or process's state) until it holds;
    fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def descendants(root: int) -> set[int]:
    """`root` and every process below it (from /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = {root}, {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def running(pid: int) -> bool:
    """The process exists and has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def random_qwen2(path=None, seed: int = 0, eos: int = 1, init_std: float | None = None):
    """A random 2-layer Qwen2 over a 64-token vocabulary (token-in/token-out tests need no
    tokenizer); saved to `path` when given. `init_std` re-draws every weight (peakier logits)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=2048,
        eos_token_id=eos,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    if init_std is not None:
        for p in model.parameters():
            p.data.normal_(0, init_std)
    if path is not None:
        model.save_pretrained(path)
    return model

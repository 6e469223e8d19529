"""Test helpers shared by several test modules."""

from __future__ import annotations


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

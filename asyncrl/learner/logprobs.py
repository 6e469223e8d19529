"""Per-token log-probabilities of response tokens, temperature-matched to the engine.

Layout (see `asyncrl.types.collate`): `input_ids = [left-padded prompt (P) | right-padded
response (R)]`. The logit that predicts response token j sits at position P - 1 + j, so the
response logits are the slice [P - 1, P + R - 1). SGLang's logprob is of `logits / T`, hence the
division by the same temperature (T = 0 means greedy; the engine reports raw logits then).
"""

from __future__ import annotations

import torch

from asyncrl.algo.kl import entropy_from_logits


def response_logits(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits [B, R, V] that predict each response token."""
    resp_len = tensors["response_mask"].shape[1]
    prompt_len = tensors["input_ids"].shape[1] - resp_len
    out = model(
        input_ids=tensors["input_ids"],
        attention_mask=tensors["attention_mask"],
        position_ids=tensors["position_ids"],
        use_cache=False,
    )
    return out.logits[:, prompt_len - 1 : prompt_len - 1 + resp_len].float()


def token_logprobs(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    temperature: float,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(token | prefix) for every response token ([B, R]) and optionally the entropy."""
    logits = response_logits(model, tensors)
    if temperature > 0:
        logits = logits / temperature
    targets = tensors["input_ids"][:, -logits.shape[1] :]
    # log_softmax via logsumexp keeps one [B, R, V] temporary instead of two.
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    logprobs = picked - torch.logsumexp(logits, dim=-1)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return logprobs, entropy


def select_rows(tensors: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same batch restricted to `rows` (1-D index tensor)."""
    return {k: v[rows] for k, v in tensors.items()}


@torch.no_grad()
def batched_logprobs(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    temperature: float,
    batch_size: int,
) -> torch.Tensor:
    """`token_logprobs` without gradients, `batch_size` rows at a time (infer_batch_size)."""
    rows = tensors["input_ids"].shape[0]
    parts = []
    for start in range(0, rows, batch_size):
        idx = torch.arange(start, min(rows, start + batch_size))
        parts.append(token_logprobs(model, select_rows(tensors, idx), temperature)[0])
    return torch.cat(parts, dim=0)

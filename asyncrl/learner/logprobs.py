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


def budget_chunks(
    attention_mask: torch.Tensor, prompt_len: int, token_budget: int
) -> list[torch.Tensor]:
    """Row indices packed into forwards of at most `token_budget` padded tokens each.

    A chunk's forward is as wide as its longest (left-padded) prompt plus its longest
    (right-padded) response, what `trimmed` keeps: it costs its rows × that width. Rows are
    sorted by length and packed greedily while the cost stays within the budget; a row longer
    than the budget gets a chunk of its own. Short rows thus share one forward instead of being
    padded to the batch's longest row a fixed count at a time.
    """
    prompts = attention_mask[:, :prompt_len].sum(dim=-1).tolist()
    responses = attention_mask[:, prompt_len:].sum(dim=-1).tolist()
    order = sorted(range(len(prompts)), key=lambda r: (prompts[r] + responses[r], r))
    chunks: list[list[int]] = []
    width = (0, 0)  # the current chunk's longest prompt and longest response
    for row in order:
        grown = (max(width[0], prompts[row]), max(width[1], responses[row]))
        if chunks and (len(chunks[-1]) + 1) * max(1, sum(grown)) <= token_budget:
            chunks[-1].append(row)
            width = grown
        else:
            chunks.append([row])
            width = (prompts[row], responses[row])
    return [torch.tensor(c, dtype=torch.long) for c in chunks]


# What `token_logprobs` reads: the full-width inputs, then the response-width mask.
_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "response_mask")


def trimmed(tensors: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The forward inputs of `rows` without the columns none of them attends to: the prompts'
    leading left padding and the responses' trailing right padding (positions are explicit in
    `position_ids`, so the remaining tokens see the same positions and the same keys)."""
    sub = {k: tensors[k][rows] for k in _FORWARD_KEYS}
    resp_len = sub["response_mask"].shape[1]
    prompt_len = sub["input_ids"].shape[1] - resp_len
    attended = sub["attention_mask"].bool().any(dim=0)
    # keep at least the last prompt column: it holds the logit of the first response token
    first = int(attended[:prompt_len].nonzero()[0]) if attended[:prompt_len].any() else 0
    first = min(first, prompt_len - 1)
    used = attended[prompt_len:].nonzero()
    keep_resp = int(used[-1]) + 1 if used.numel() else 1
    out = {k: sub[k][:, first : prompt_len + keep_resp] for k in _FORWARD_KEYS[:3]}
    out["response_mask"] = sub["response_mask"][:, :keep_resp]
    return out


@torch.no_grad()
def budget_logprobs(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    temperature: float,
    token_budget: int,
) -> torch.Tensor:
    """`token_logprobs` without gradients in forwards of at most `token_budget` padded tokens
    (`budget_chunks`, each chunk `trimmed`). Positions a chunk cut off (padding after every
    row's response) come back as 0.0: every consumer reads them under the response mask."""
    rows, resp_len = tensors["response_mask"].shape
    out = torch.zeros(rows, resp_len, dtype=torch.float32, device=tensors["input_ids"].device)
    prompt_len = tensors["input_ids"].shape[1] - resp_len
    for idx in budget_chunks(tensors["attention_mask"], prompt_len, token_budget):
        logp = token_logprobs(model, trimmed(tensors, idx.to(out.device)), temperature)[0]
        out[idx.to(out.device), : logp.shape[1]] = logp
    return out


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether a training-mode forward of `model` is random: a dropout module with p > 0, or a
    config rate named *dropout* above 0 (HF attention applies `attention_dropout` inline). Then
    the training forward is not the proximal policy and its logprobs cannot stand in for it."""
    modules = (m for m in model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd))
    if any(m.p > 0 for m in modules):
        return True
    config = getattr(model, "config", None)
    settings = config.to_dict() if hasattr(config, "to_dict") else {}
    rates = (v for k, v in settings.items() if "dropout" in k)
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in rates)

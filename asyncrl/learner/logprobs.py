"""Per-token log-probabilities of response tokens, temperature-matched to the engine.

Layout (see `asyncrl.learner.collate.collate`): `input_ids = [left-padded prompt (P) | right-padded
response (R)]`. The logit that predicts response token j sits at position P - 1 + j, so the
response logits are the slice [P - 1, P + R - 1). SGLang's logprob is of `logits / T`, hence the
division by the same temperature (T = 0 means greedy; the engine reports raw logits then).
The forwards return the final hidden states, not the logits: only the response positions' are
projected through the LM head, a chunk of tokens at a time (`asyncrl.learner.chunked`), so no
[tokens x vocabulary] tensor exists whole (`output_head` says where the model's own logits are
computed instead).
With `actor.use_dynamic_bsz` the same values come from packed forwards of the real tokens only
(`asyncrl.learner.packing`), unpacked into this layout. With a process group of W > 1 ranks
every function here runs the same number of forwards on every rank (FSDP2's are collectives).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncrl.algo.kl import entropy_from_logits
from asyncrl.config.schema import ActorConfig
from asyncrl.learner import chunked, packing, routing
from asyncrl.learner.chunked import Projection, forward, output_head, picked

Logits = chunked.Logits
#: (model, the padded batch's tensors) -> the logits [B, R, V] that predict its response tokens.
LogitsFn = Callable[[torch.nn.Module, dict[str, torch.Tensor]], Logits]


def score(
    logits: Logits, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[target] (T = 0: the raw logits) and optionally the entropy:
    chunked for a `Projection`, else on the fp32 logits."""
    if isinstance(logits, Projection):
        return chunked.token_logprobs(logits, targets, temperature, with_entropy)
    if temperature > 0:
        logits = logits / temperature
    return _score(logits, targets, with_entropy)


def response_logits(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Logits:
    """Logits [B, R, V] that predict each response token."""
    resp_len = tensors["response_mask"].shape[1]
    prompt_len = tensors["input_ids"].shape[1] - resp_len
    with routing.replay(model, tensors.get("routes")):  # MoE with R3: the engine's routes
        out = forward(
            model,
            input_ids=tensors["input_ids"],
            attention_mask=tensors["attention_mask"],
            position_ids=tensors["position_ids"],
            use_cache=False,
        )
    return picked(model, out, lambda x: x[:, prompt_len - 1 : prompt_len - 1 + resp_len])


def token_logprobs(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    temperature: float,
    with_entropy: bool = False,
    packed: bool = False,
    logits_fn: LogitsFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(token | prefix) for every response token ([B, R]) and optionally the entropy;
    `packed`: from one packed forward of the real tokens (`packed_token_logprobs`); else the
    response logits from `logits_fn` (default `response_logits`; `shared_prompt_logits` or the
    lean `learner.lean` one run each group's prompt once)."""
    if packed:
        return packed_token_logprobs(model, tensors, temperature, with_entropy)
    logits = (logits_fn or response_logits)(model, tensors)
    width = (logits.hidden if isinstance(logits, Projection) else logits).shape[1]
    return score(logits, tensors["input_ids"][:, -width:], temperature, with_entropy)


def shared_prompt_logits(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Logits:
    """`response_logits` with each group's prompt run once: rows of one group are consecutive
    and share their prompt columns (`collate`'s layout, `group_index`), so the prompt forward
    covers one row per group and its KV cache is gathered out to the group's rows, whose
    responses then attend to it. A GRPO batch of n samples per prompt computes n× fewer prompt
    tokens; the values equal the padded path's (same positions, same masks). Always two
    forwards (data-parallel ranks must agree on the count); needs a model whose layers keep
    the cache (HF's checkpointed layers drop it: activation checkpointing off)."""
    resp_len = tensors["response_mask"].shape[1]
    prompt_len = tensors["input_ids"].shape[1] - resp_len
    heads, owner = prompt_owners(tensors["group_index"])
    cols = slice(0, prompt_len)
    out = forward(
        model,
        input_ids=tensors["input_ids"][heads, cols],
        attention_mask=tensors["attention_mask"][heads, cols],
        position_ids=tensors["position_ids"][heads, cols],
        use_cache=True,
    )
    cache = out.past_key_values
    cache.batch_select_indices(owner)  # differentiable: an index into each layer's K and V
    rest = forward(
        model,
        input_ids=tensors["input_ids"][:, prompt_len:],
        attention_mask=tensors["attention_mask"],
        position_ids=tensors["position_ids"][:, prompt_len:],
        past_key_values=cache,
        use_cache=True,
    )
    # The prompt's last logit predicts response token 0; response token j predicts j + 1.
    first = picked(model, out, lambda x: x[owner, -1:])
    later = picked(model, rest, lambda x: x[:, : resp_len - 1])
    if isinstance(first, Projection):
        return Projection(torch.cat([first.hidden, later.hidden], dim=1), first.weight, first.bias)
    return torch.cat([first, later], dim=1)


def prompt_owners(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(heads, owner) of a batch whose rows of one group are consecutive (`collate`'s
    `group_index`): the first row of each group, and each row's index into `heads`."""
    first = torch.ones_like(groups, dtype=torch.bool)
    first[1:] = groups[1:] != groups[:-1]
    return first.nonzero().squeeze(-1), torch.cumsum(first.long(), 0) - 1


def _score(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits)[target] (and the entropy) over the last axis; logits already /T."""
    # log_softmax via logsumexp keeps one [..., V] temporary instead of two.
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    logprobs = picked - torch.logsumexp(logits, dim=-1)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return logprobs, entropy


def packed_token_logprobs(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    temperature: float,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` from one packed forward of the rows' real tokens (`packing.pack`): the
    same [B, R] results (0.0 at padding), the same temperature rule, no padded token computed.
    Only the logits that predict response tokens are projected (chunked where `output_head`
    is taken, else through `logits_to_keep`)."""
    packed = packing.pack(tensors, one_row=packing.one_row(model))
    chunked_head = output_head(model) is not None
    keep = packed.keep
    if keep.numel() == 0:  # no response token: one logit keeps the graph (and FSDP) connected
        keep = torch.tensor([packed.input_ids.shape[1] - 1], device=keep.device)
    out = packing.forward(
        model,
        packed,
        # chunked: the hidden states, and one position's logits (unused) in place of the rest
        logits_to_keep=1 if chunked_head else keep,
        **({"output_hidden_states": True} if chunked_head else {}),
    )
    if packed.logit_index.numel() == 0:
        anchor = out.logits.sum() * 0.0
        zeros = torch.zeros(packed.shape, device=out.logits.device) + anchor
        return zeros, (zeros.clone() if with_entropy else None)
    if chunked_head:
        logits = picked(model, out, lambda x: x.reshape(-1, x.shape[-1])[packed.logit_index])
    else:
        logits = out.logits.reshape(-1, out.logits.shape[-1])[packed.select].float()
    logprobs, entropy = score(logits, packed.targets, temperature, with_entropy)
    entropy = packing.unpack(entropy, packed) if entropy is not None else None
    return packing.unpack(logprobs, packed), entropy


def pack_budget(actor: ActorConfig) -> int | None:
    """Real tokens per packed forward with `actor.use_dynamic_bsz`; None: the padded path."""
    return actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None


def train_micro_batches(
    attention_mask: torch.Tensor,
    rows: torch.Tensor,
    micro: int,
    actor: ActorConfig,
    across_ranks: bool = False,
) -> list[torch.Tensor]:
    """A mini-batch's `rows` as micro-batches: `micro` rows at a time, or with
    `actor.use_dynamic_bsz` token-balanced ones under `ppo_max_token_len_per_gpu` real tokens
    (`packing.micro_batches`: as many as on the rank with the most). Empty ones are left out:
    the learner pads every rank to the same number of passes with zero-loss ones."""
    budget = pack_budget(actor)
    if budget is None:
        return [rows[i : i + micro] for i in range(0, len(rows), micro)]
    lengths = packing.real_lengths(attention_mask[rows])
    parts = packing.micro_batches(lengths, budget, across_ranks)
    return [rows[torch.tensor(p, dtype=torch.long)] for p in parts if p]


def empty_forward(model: torch.nn.Module, device: torch.device | str) -> torch.Tensor:
    """A one-token forward with nothing to learn from: what a data-parallel rank without rows
    runs so that every rank runs the same number of forwards (FSDP2 forwards are
    collectives). Returns a zero loss still attached to the graph (for a matching backward)."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    logits = model(input_ids=ids, use_cache=False).logits
    return logits.float().sum() * 0.0


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` (or a module inside it: peft, the adapter-off view) is FSDP2-sharded:
    then its every forward is a collective that all ranks must run together."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _forwards(model: torch.nn.Module, own: int) -> int:
    """How many forwards this rank runs for its `own` ones: the most any rank runs when the
    model is sharded, agreed BEFORE any forward (a rank's all-reduce must never meet another
    rank's parameter gather); `own` otherwise."""
    return packing.global_max(own, is_sharded(model))


def _pad_forwards(model: torch.nn.Module, own: int, total: int, device: torch.device | str):
    """The `total - own` empty forwards a rank with fewer rows runs (see `empty_forward`)."""
    for _ in range(total - own):
        empty_forward(model, device)


@torch.no_grad()
def packed_logprobs(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    temperature: float,
    token_budget: int,
) -> torch.Tensor:
    """`token_logprobs` without gradients in packed forwards of at most `token_budget` real
    tokens (`packing.micro_batches`: the same count on every data-parallel rank)."""
    rows, resp_len = tensors["response_mask"].shape
    device = tensors["input_ids"].device
    out = torch.zeros(rows, resp_len, dtype=torch.float32, device=device)
    lengths = packing.real_lengths(tensors["attention_mask"])
    for part in packing.micro_batches(lengths, token_budget, is_sharded(model)):
        if not part:
            empty_forward(model, device)
            continue
        idx = torch.tensor(part, dtype=torch.long, device=device)
        out[idx] = packed_token_logprobs(model, select_rows(tensors, idx), temperature)[0]
    return out


def select_rows(tensors: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same batch restricted to `rows` (1-D index tensor)."""
    return {k: v[rows] for k, v in tensors.items()}


@torch.no_grad()
def batched_logprobs(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    temperature: float,
    batch_size: int,
    pack_budget: int | None = None,
) -> torch.Tensor:
    """`token_logprobs` without gradients, `batch_size` rows at a time (infer_batch_size), or
    packed under `pack_budget` real tokens per forward (`packed_logprobs`) when it is set.
    Every data-parallel rank runs the same number of forwards."""
    if pack_budget is not None:
        return packed_logprobs(model, tensors, temperature, pack_budget)
    rows, resp_len = tensors["response_mask"].shape
    device = tensors["input_ids"].device
    parts = [torch.zeros(0, resp_len, dtype=torch.float32, device=device)]
    total = _forwards(model, -(-rows // batch_size))
    for start in range(0, rows, batch_size):
        idx = torch.arange(start, min(rows, start + batch_size))
        parts.append(token_logprobs(model, select_rows(tensors, idx), temperature)[0])
    _pad_forwards(model, len(parts) - 1, total, device)
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
    if tensors.get("routes") is not None:  # replayed routes: per position, cut the same way
        out["routes"] = tensors["routes"][rows][:, first : prompt_len + keep_resp]
    return out


@torch.no_grad()
def budget_logprobs(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    temperature: float,
    token_budget: int,
    pack_budget: int | None = None,
    routes_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`token_logprobs` without gradients in forwards of at most `token_budget` padded tokens
    (`budget_chunks`, each chunk `trimmed`), or packed under `pack_budget` real tokens when it is
    set (`packed_logprobs`). Positions a chunk cut off (padding after every row's response)
    come back as 0.0: every consumer reads them under the response mask. Every data-parallel
    rank runs the same number of forwards. `routes_out` ([B, T, layers * top_k]): each
    forward's routes are recorded into it (`routing.recording_into`; padded forwards only)."""
    if pack_budget is not None:
        if routes_out is not None:
            raise ValueError("routes are recorded in padded forwards, not packed ones")
        return packed_logprobs(model, tensors, temperature, pack_budget)
    rows, resp_len = tensors["response_mask"].shape
    out = torch.zeros(rows, resp_len, dtype=torch.float32, device=tensors["input_ids"].device)
    prompt_len = tensors["input_ids"].shape[1] - resp_len
    chunks = budget_chunks(tensors["attention_mask"], prompt_len, token_budget)
    total = _forwards(model, len(chunks))
    for idx in chunks:
        sub = trimmed(tensors, idx.to(out.device))
        first = prompt_len - (sub["input_ids"].shape[1] - sub["response_mask"].shape[1])
        with routing.recording_into(model, routes_out, idx, first):
            logp = token_logprobs(model, sub, temperature)[0]
        out[idx.to(out.device), : logp.shape[1]] = logp
    _pad_forwards(model, len(chunks), total, out.device)
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

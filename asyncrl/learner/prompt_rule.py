"""When running each group's prompt once pays (`actor.share_prompt_forward`): a cost model of
the training forward's paths on a micro-batch's shapes, and the `LogitsFn` that takes the
cheapest.

The paths, on a micro-batch of B rows in g groups, a P-column prompt and R-column responses:
- "whole": every row's prompt and response in one forward: B (P + R) tokens through the
  projections and the MLP, B (P + R)^2 query-key pairs through attention, half of them where
  the batch has no padding (transformers then passes SDPA `is_causal`, whose kernels skip the
  keys after each query; with padding it builds a mask, which SDPA computes in full).
- "shared": each group's prompt once (g P tokens, g P^2 pairs, half without padding), then
  the responses (B R tokens) against [the group's prompt keys | their own] under a mask: B R
  (P + R) pairs, all computed.
- "shared, causal" (the lean forward only, `learner/lean.py`): the same tokens; the responses
  attend causally with their prompt's keys laid before them (B (P + R)^2 / 2 pairs).

Cost = tokens x 2 (the decoder layers' parameters) + pairs x 4 L H D (QK^T and PV over every
layer's query heads); backward is ~2x each side, the LM head the same on every path. Why this
and not a threshold: the shared forward saves (G - 1) / G of the prompt's tokens but, at a
long response, its masked attention computes R (P + R) pairs where a padding-free whole
forward computes (P + R)^2 / 2: measured on one CPU thread (embedded-size model, 8 rows per
prompt, fwd + bwd, equal response lengths) prompt 32 / response 1024 ran 1.40x slower shared
under the mask, 1024 / 64 4.8x faster, and the rule's path was within the noise (±4 %) of the
fastest at all five shapes measured (`asyncrl bench train --shared-prompt`,
bench/results/train_shared_prompt.json).

With FSDP2 (more than one rank) every forward is a collective, so the ranks sum their costs
(one all-reduce per micro-batch) and take the same path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from asyncrl.learner.logprobs import Logits, LogitsFn

log = logging.getLogger(__name__)

WHOLE, SHARED, SHARED_CAUSAL = "whole", "shared", "shared, causal"


@dataclass(frozen=True)
class Shape:
    """What the cost of a micro-batch's forward depends on."""

    rows: int
    """B: rows (responses) in the micro-batch."""
    groups: int
    """g: groups (distinct prompts) among them."""
    prompt: int
    """P: prompt columns (left-padded to the batch's longest prompt)."""
    response: int
    """R: response columns (right-padded to the batch's longest response)."""
    padded: bool
    """Whether any row has a padding column (a whole forward then attends under a mask)."""
    prompt_padded: bool
    """Whether any group's prompt has a padding column (the prompt pass's mask)."""


def shape_of(tensors: dict[str, torch.Tensor]) -> Shape:
    """The `Shape` of a padded micro-batch (`collate`'s layout: a group's rows consecutive,
    sharing their prompt columns). A few small reductions: the embedded model's step is per-op
    overhead."""
    mask, groups = tensors["attention_mask"], tensors["group_index"]
    rows, width = mask.shape
    response = tensors["response_mask"].shape[1]
    return Shape(
        rows=rows,
        groups=1 + int((groups[1:] != groups[:-1]).sum()),
        prompt=width - response,
        response=response,
        padded=not bool(mask.all()),
        prompt_padded=not bool(mask[:, : width - response].all()),
    )


@dataclass(frozen=True)
class Costs:
    """A model's forward FLOPs per token (projections, MLP) and per query-key pair."""

    token: float
    pair: float


def model_costs(model: torch.nn.Module) -> Costs:
    """`Costs` of `model` from its config (heads, head size, layers) and its decoder layers'
    parameters (an FSDP2 shard counts as its whole: `numel` of a DTensor is global)."""
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    layers = int(cfg.num_hidden_layers)
    # the decoder's layer list, wherever a wrapper (peft) keeps it
    blocks = next((m for n, m in model.named_modules() if n.endswith("layers")
                   and isinstance(m, torch.nn.ModuleList)), None)  # fmt: skip
    params = sum(p.numel() for p in blocks.parameters()) if blocks is not None else 0
    if not params:  # no `layers` to count: the whole model less its embeddings
        embed = model.get_input_embeddings().weight.numel()
        params = sum(p.numel() for p in model.parameters()) - 2 * embed
    return Costs(token=2.0 * params, pair=4.0 * layers * heads * head_dim)


def path_costs(costs: Costs, s: Shape, paths: list[str]) -> list[float]:
    """The modelled forward cost of each of `paths` on a micro-batch of shape `s`."""
    width = s.prompt + s.response
    whole_pairs = s.rows * width**2 * (1.0 if s.padded else 0.5)
    prompt_pairs = s.groups * s.prompt**2 * (1.0 if s.prompt_padded else 0.5)
    shared_tokens = s.groups * s.prompt + s.rows * s.response
    pairs = {
        WHOLE: whole_pairs,
        SHARED: prompt_pairs + s.rows * s.response * width,
        SHARED_CAUSAL: prompt_pairs + s.rows * width**2 / 2,
    }
    tokens = {WHOLE: s.rows * width, SHARED: shared_tokens, SHARED_CAUSAL: shared_tokens}
    return [tokens[p] * costs.token + pairs[p] * costs.pair for p in paths]


def cheapest(paths: list[str], cost: list[float]) -> str:
    """The path of least cost; a tie keeps the earlier one (the shared paths come first)."""
    return paths[min(range(len(paths)), key=lambda i: (cost[i], i))]


class SharedPromptRule:
    """A `LogitsFn` that runs each micro-batch on the path `path_costs` says is cheapest among
    `paths` (name -> `LogitsFn`, the shared ones first), logging each path once when it is
    first taken. `agree`: sum the costs over the default process group first (FSDP2: every
    rank must run the same forwards)."""

    def __init__(self, model: torch.nn.Module, paths: dict[str, LogitsFn], agree: bool) -> None:
        self.paths, self.agree = paths, agree
        self.costs = model_costs(model)
        self._logged: set[str] = set()

    def choose(self, tensors: dict[str, torch.Tensor]) -> str:
        """The path this micro-batch runs."""
        names = list(self.paths)
        s = shape_of(tensors)
        cost = path_costs(self.costs, s, names)
        if self.agree:
            cost = _summed(cost)
        name = cheapest(names, cost)
        if name not in self._logged:
            self._logged.add(name)
            modelled = ", ".join(f"{n} {c / cost[0]:.2f}x" for n, c in zip(names, cost))
            log.info(
                "learner: the training forward runs %r from a micro-batch of %d rows in %d "
                "groups, prompt %d / response %d columns (modelled cost: %s; "
                "actor.share_prompt_forward decides per micro-batch, logged once a path)",
                name, s.rows, s.groups, s.prompt, s.response, modelled,
            )  # fmt: skip
        return name

    def __call__(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Logits:
        return self.paths[self.choose(tensors)](model, tensors)


def _summed(values: list[float]) -> list[float]:
    """`values` summed element-wise over the default process group (gloo: on the CPU)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device = "cpu" if dist.get_backend() == "gloo" or accel is None else accel
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.tolist()

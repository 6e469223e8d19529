"""Mixture-of-experts routing: record the experts a model routes each token to, or replay given
ones (rollout routing replay, R3), on one model instance.

The routers of transformers' Qwen3-MoE and Qwen2-MoE (`*TopKRouter`: logits = x W^T, probs =
softmax(logits) in fp32, top-k of the probs, renormalised over the k when `norm_topk_prob`)
are given a forward of this module's (`install`) that computes the same arithmetic and also:

- records each call's top-k expert ids (`Tap.take()`: [tokens, layers, k] uint8, tokens in the
  forward's own flattening of [batch, time]): what the hf engine returns per token;
- replays given ids (`Tap.replaying(routes)`): the experts of each token are the given ones,
  their weights the router's OWN probabilities of those experts (renormalised over them as
  `norm_topk_prob` says), so the router's parameters still get gradients through them (verl's
  and Megatron-core's R3). A token whose row holds `UNROUTED` in a layer routes itself there
  (top-k of its own probabilities): positions the engine never forwarded, or tokens no engine
  generated. Meanwhile the router's own top-k is compared with the replayed one: `Tap.stats`
  counts the (token, layer) pairs whose sets differ (the routing mismatch R3 removes).

The state lives on the model (`tap_of(model)`), and each router holds it as an attribute, so a
`copy.deepcopy` of the model (the hf engine's kept lanes) records into its own copy.
This module imports torch and the config's table of MoE model types only.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from asyncrl.config.moe_checks import MOE_TYPES

#: Route value of a (token, layer) with no recorded experts: the learner routes it itself.
UNROUTED = 255
#: Expert ids travel as uint8, `UNROUTED` reserved: models with more experts are refused.
MAX_EXPERTS = UNROUTED
_ATTR = "_asyncrl_tap"


#: transformers' fused expert parameters of a layer (`mlp.experts.*`: [experts, 2 x I, H] with
#: each expert's gate rows before its up rows, and [experts, H, I]).
FUSED_GATE_UP, FUSED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def checkpoint_tensors(
    named: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` with each fused expert parameter split into the checkpoint's per-expert tensors
    (`mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I]; views,
    no copies). Why: weights leave the learner in the names a model's checkpoint holds, the
    ones every engine loads at start (SGLang's and vLLM's MoE loaders map per-expert names into
    their own fused layout; the hf engine copies them into its slices), so a sync goes through
    the loader the engine's start already ran. Other tensors pass unchanged."""
    for name, tensor in named:
        fused_gate_up = name.endswith(FUSED_GATE_UP) and tensor.dim() == 3
        if not (fused_gate_up or (name.endswith(FUSED_DOWN) and tensor.dim() == 3)):
            yield name, tensor
            continue
        prefix = name[: -len("gate_up_proj" if fused_gate_up else "down_proj")]
        half = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            if fused_gate_up:
                yield f"{prefix}{e}.gate_proj.weight", tensor[e, :half]
                yield f"{prefix}{e}.up_proj.weight", tensor[e, half:]
            else:
                yield f"{prefix}{e}.down_proj.weight", tensor[e]


class RoutesError(ValueError):
    """Routes that cannot be replayed on this model (shape, expert ids)."""


class Tap:
    """Per-model routing state: what the last forwards recorded, what to replay, the counts."""

    def __init__(self, layers: int, top_k: int, num_experts: int) -> None:
        self.layers, self.top_k, self.num_experts = layers, top_k, num_experts
        self.recording = False
        self._captured: list[torch.Tensor | None] = [None] * layers
        self._replay: torch.Tensor | None = None  # [tokens, layers, k] long
        self.stats = {"routed": 0, "replayed": 0, "differ": 0}

    def take(self) -> torch.Tensor:
        """The last forward's routes [tokens, layers, k] uint8 (on the CPU); cleared."""
        if any(c is None for c in self._captured):
            raise RuntimeError("no complete forward was recorded")
        out = torch.stack(self._captured, dim=1)  # type: ignore[arg-type]
        self._captured = [None] * self.layers
        return out

    @contextlib.contextmanager
    def recording_routes(self) -> Iterator[Tap]:
        self.recording, self._captured = True, [None] * self.layers
        try:
            yield self
        finally:
            self.recording = False

    @contextlib.contextmanager
    def replaying(self, routes: torch.Tensor | None) -> Iterator[Tap]:
        """Forwards inside replay `routes` ([batch, time, layers, k] or [tokens, layers, k],
        integers; `UNROUTED` where the router decides). None: the router decides everywhere."""
        if routes is not None:
            if routes.shape[-2:] != (self.layers, self.top_k):
                raise RoutesError(
                    f"routes of shape {tuple(routes.shape)}: this model has {self.layers} MoE "
                    f"layers, top-k {self.top_k}"
                )
            routes = routes.reshape(-1, self.layers, self.top_k).long()
            bad = (routes >= self.num_experts) & (routes != UNROUTED)
            if bool(bad.any()):
                raise RoutesError(f"routes name an expert >= {self.num_experts} (the model's)")
        previous, self._replay = self._replay, routes
        try:
            yield self
        finally:
            self._replay = previous

    def reset_stats(self) -> dict[str, int]:
        """The counts since the last reset (then zeroed)."""
        out, self.stats = self.stats, {"routed": 0, "replayed": 0, "differ": 0}
        return out

    def _route(self, layer: int, logits: torch.Tensor, k: int, norm: bool):
        """(weights, experts) of one router call: its own top-k, or the replayed ids."""
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        top, experts = torch.topk(probs, k, dim=-1)
        replay = self._replay
        if replay is not None:
            if replay.shape[0] != logits.shape[0]:
                raise RoutesError(
                    f"routes for {replay.shape[0]} tokens, the forward has {logits.shape[0]}"
                )
            given = replay[:, layer].to(experts.device)
            use = (given != UNROUTED).all(-1, keepdim=True)
            own = experts
            experts = torch.where(use, given, own)
            top = probs.gather(-1, experts)  # differentiable: the router still learns
            self._count(own, experts, use)
        if norm:
            top = top / top.sum(dim=-1, keepdim=True)
        if self.recording:
            self._captured[layer] = experts.detach().to("cpu", torch.uint8)
        return top.to(logits.dtype), experts

    @torch.no_grad()
    def _count(self, own: torch.Tensor, used: torch.Tensor, replayed: torch.Tensor) -> None:
        same = (own.sort(-1).values == used.sort(-1).values).all(-1)
        self.stats["routed"] += own.shape[0]
        self.stats["replayed"] += int(replayed.sum())
        self.stats["differ"] += int((~same & replayed.squeeze(-1)).sum())


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order ([] for a dense model)."""
    found = []
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k"):
            found.append(module)
    return found


def unsupported(model: torch.nn.Module) -> str | None:
    """Why routes cannot be recorded or replayed on `model` (None: they can)."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in MOE_TYPES:
        return f"model type {kind!r} is not a mixture of experts this knows ({sorted(MOE_TYPES)})"
    found = routers(model)
    if not found:
        return "no MoE router modules found"
    if len({(r.top_k, r.num_experts) for r in found}) != 1:
        return "layers differ in top-k or expert count"
    if found[0].num_experts > MAX_EXPERTS:
        return f"{found[0].num_experts} experts: routes travel as uint8 (at most {MAX_EXPERTS})"
    return None


def tap_of(model: torch.nn.Module) -> Tap | None:
    """The model's `Tap` once `install`ed (None before, or for a dense model)."""
    return getattr(model, _ATTR, None)


def install(model: torch.nn.Module) -> Tap:
    """Give every router of `model` this module's forward (same arithmetic, plus recording and
    replay); idempotent. RoutesError when `unsupported`."""
    if (tap := tap_of(model)) is not None:
        return tap
    if (why := unsupported(model)) is not None:
        raise RoutesError(why)
    found = routers(model)
    tap = Tap(len(found), found[0].top_k, found[0].num_experts)
    for layer, router in enumerate(found):
        router._asyncrl_tap, router._asyncrl_layer = tap, layer
        router.forward = types.MethodType(_router_forward, router)
    setattr(model, _ATTR, tap)
    return tap


def _router_forward(self: torch.nn.Module, hidden_states: torch.Tensor):
    """transformers' `*TopKRouter.forward` (logits, weights, experts), through the tap."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    top, experts = self._asyncrl_tap._route(
        self._asyncrl_layer, logits, self.top_k, self.norm_topk_prob
    )
    return logits, top, experts

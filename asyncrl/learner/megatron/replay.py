"""Rollout routing replay (R3, `actor.router_replay: r3`) in the Megatron learner, through
megatron-core's own router-replay hook.

megatron-core (0.16+: `megatron/core/transformer/moe/router_replay.py`) routes through
`TopKRouter.router_replay.get_replay_topk(scores, topk, num_groups, group_topk,
default_compute_topk)` whenever a router holds one: in its REPLAY_FORWARD action the experts are
the given indices and their weights the router's own scores gathered at them (softmax of the
gathered logits: the router's own probabilities renormalised over the replayed experts, as
`norm_topk_prob` does), so the router still gets gradients. `PositionReplay` is that class with
one change asyncrl's routes need: a token whose row holds `UNROUTED` (a position no engine
forwarded) takes the router's own top-k there, as the torch learner's replay does
(`asyncrl.moe`); Megatron's own class replays every token or none. It also keeps the experts
each token used, so a test can check them.

Layout: the batch's routes [B, P+R, layers * k] (collate's left-padded rows) are right-aligned
like the tokens (`align_routes`), and a micro-batch's rows [b, s] are handed to each router in
Megatron's token order, sequence-major ([s, b] flattened), one MoE layer's columns per router.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.moe import UNROUTED


class ReplayError(ValueError):
    """Routes this Megatron model cannot replay."""


def replay_base() -> type:
    """megatron-core's RouterReplay, or ReplayError naming the release that lacks it."""
    try:
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    except ImportError:
        from asyncrl.learner.megatron.compat import installed_version

        raise ReplayError(f"actor.router_replay: r3 needs megatron-core's router replay "
                          f"(0.16+), not in megatron-core {installed_version()}") from None  # fmt: skip
    del RouterReplayAction
    return RouterReplay


def _make_class() -> type:
    base = replay_base()
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    class PositionReplay(base):  # type: ignore[misc, valid-type]
        """One router's replay: megatron-core's, with `UNROUTED` rows routed by the router."""

        def __init__(self) -> None:
            super().__init__()
            # not in megatron's global list (its static calls): this learner drives each one
            base.global_router_replay_instances.remove(self)
            self.counts = [0, 0, 0]  # routed tokens, replayed ones, replayed with another top-k

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                            default_compute_topk=None):  # fmt: skip
            if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
                return super().get_replay_topk(scores, topk, num_groups, group_topk,
                                               default_compute_topk)  # fmt: skip
            _, own = default_compute_topk(scores, topk, num_groups=num_groups,
                                          group_topk=group_topk)  # fmt: skip
            given = self.target_topk_idx.to(scores.device)
            if given.shape != own.shape:
                raise ReplayError(f"routes for {given.shape[0]} tokens, top-{given.shape[1]}; "
                                  f"the router has {own.shape[0]}, top-{own.shape[1]}")  # fmt: skip
            use = (given != UNROUTED).all(-1, keepdim=True)
            experts = torch.where(use, given, own)
            with torch.no_grad():
                same = (own.sort(-1).values == experts.sort(-1).values).all(-1)
                self.counts[0] += own.shape[0]
                self.counts[1] += int(use.sum())
                self.counts[2] += int((~same & use.squeeze(-1)).sum())
            return scores.gather(1, experts), experts

    return PositionReplay


class Replayer:
    """Every MoE router of this rank's model chunks, fed the routes of each micro-batch. With
    `watch` on, each forward's routing maps (the experts Megatron dispatched every token to)
    are kept per router (`maps`), for tests."""

    def __init__(self, chunks: list[torch.nn.Module], moe_layers: tuple[int, ...], top_k: int):
        from megatron.core.transformer.moe.router import TopKRouter

        cls = _make_class()
        self.top_k, self.columns, self.replays = top_k, [], []
        self.watch, self.maps = False, []
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    layer = module.layer_number - 1  # Megatron's global, 1-based layer number
                    if layer not in moe_layers:
                        raise ReplayError(f"router of layer {layer} is not an MoE layer's")
                    module.router_replay = cls()
                    self.columns.append(moe_layers.index(layer))
                    self.replays.append(module.router_replay)
                    module.register_forward_hook(self._keep_map(len(self.replays) - 1))
        self.layers = len(moe_layers)

    def set(self, routes: torch.Tensor | None) -> None:
        """Replay `routes` [b, s, layers * k] (this micro-batch's aligned rows) in the next
        forward; None: every router routes itself."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if routes is None:
            for r in self.replays:
                r.router_replay_action = None
            return
        b, s, width = routes.shape
        if width != self.layers * self.top_k:
            raise ReplayError(f"routes of {width} ids per position; the policy has "
                              f"{self.layers} MoE layers, top-k {self.top_k}")  # fmt: skip
        per = routes.view(b, s, self.layers, self.top_k).transpose(0, 1).reshape(-1, self.layers,
                                                                                 self.top_k)  # fmt: skip
        for column, r in zip(self.columns, self.replays, strict=True):
            r.target_topk_idx = per[:, column].long()
            r.router_replay_action = RouterReplayAction.REPLAY_FORWARD

    def take_counts(self) -> list[int]:
        """(routed, replayed, replayed with another own top-k) token-layers since the last
        call, summed over this rank's routers; zeroed."""
        out = [sum(r.counts[i] for r in self.replays) for i in range(3)]
        for r in self.replays:
            r.counts = [0, 0, 0]
        return out

    def _keep_map(self, router: int):
        def hook(module, args, output) -> None:
            if self.watch:  # output: (probs, routing_map [tokens, experts] bool)
                self.maps.append((self.columns[router], output[1].detach().cpu()))

        return hook

    def used(self, rows: int, seq: int, forwards: list[torch.Tensor]) -> torch.Tensor:
        """The experts the watched forwards dispatched each token to, [rows, seq, layers, k]
        (sorted ids; -1 where a token had not exactly k, or rows no forward ran): `forwards`
        are the row indices of each watched forward, in order."""
        out = torch.full((rows, seq, self.layers, self.top_k), -1, dtype=torch.long)
        per = len(self.replays)
        for f, idx in enumerate(forwards):
            for column, routing_map in self.maps[f * per : (f + 1) * per]:
                m = routing_map.view(seq, len(idx), -1).transpose(0, 1)
                ids = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)[..., : self.top_k]
                ids = torch.where((m.sum(-1) == self.top_k)[..., None], ids, -1)
                out[idx, :, column] = ids
        self.maps = []
        return out


def align_routes(routes: torch.Tensor, data: dict[str, torch.Tensor]) -> torch.Tensor:
    """collate's routes [B, P+R, W] -> the right-aligned rows of `batch.right_align` (row i
    drops its left pads); `UNROUTED` after each row's tokens."""
    mask = data["attention_mask"].bool()
    rows, width = mask.shape
    prompt_width = width - data["response_mask"].shape[1]
    shift = prompt_width - mask[:, :prompt_width].sum(dim=1)
    seq = data["tokens"].shape[1]
    out = torch.full((rows, seq, routes.shape[2]), UNROUTED, dtype=torch.long,
                     device=routes.device)  # fmt: skip
    cols = torch.arange(width, device=routes.device).expand(rows, width)
    keep = cols >= shift[:, None]
    out[keep.nonzero(as_tuple=True)[0], (cols - shift[:, None])[keep]] = routes[keep].long()
    return out


def unalign(aligned: torch.Tensor, data: dict[str, torch.Tensor]) -> torch.Tensor:
    """Inverse of `align_routes`: right-aligned rows [B, S, ...] -> collate's [B, P+R, ...]
    (-1 at the left pads)."""
    mask = data["attention_mask"].bool()
    rows, width = mask.shape
    prompt_width = width - data["response_mask"].shape[1]
    shift = (prompt_width - mask[:, :prompt_width].sum(dim=1)).cpu()
    out = torch.full((rows, width, *aligned.shape[2:]), -1, dtype=aligned.dtype)
    cols = torch.arange(width).expand(rows, width)
    keep = cols >= shift[:, None]
    out[keep] = aligned[keep.nonzero(as_tuple=True)[0], (cols - shift[:, None])[keep]]
    return out


def make_replayer(chunks: list[torch.nn.Module], config: Any, hf: dict) -> Replayer:
    """The Replayer of the policy's chunks (ReplayError where this layout cannot replay)."""
    from asyncrl.config.moe_checks import moe_layers

    check_replayable(config)
    return Replayer(chunks, moe_layers(hf), int(hf["num_experts_per_tok"]))


def check_replayable(config: Any) -> None:
    """What this learner's layout cannot replay routes under, as one line."""
    if not config.num_moe_experts:
        raise ReplayError("actor.router_replay: r3 needs a mixture-of-experts policy")
    if config.sequence_parallel:
        raise ReplayError("actor.router_replay: r3 with sequence_parallel is not supported by "
                          "the Megatron learner (the routers see a TP-scattered sequence)")  # fmt: skip
    if config.recompute_granularity is not None:
        raise ReplayError("actor.router_replay: r3 needs activation recompute off (the "
                          "recomputed forward would route itself)")  # fmt: skip


def replay_metrics(replayer: Replayer, device: torch.device) -> dict[str, float]:
    """r3: the share of routed token-layers that were replayed, and of those the share whose
    own top-k differs (the torch learner's `routing.replay_metrics`), since the last call,
    summed over every rank (each routes its own tokens of its own layers; TP > 1 needs sequence
    parallelism with experts, which r3 refuses, so no token is counted twice)."""
    counts = torch.tensor(replayer.take_counts(), dtype=torch.float64, device=device)
    torch.distributed.all_reduce(counts)
    routed, replayed, differ = counts.tolist()
    return {
        "learner/router_replayed_frac": replayed / max(1.0, routed),
        "learner/router_differ_frac": differ / max(1.0, replayed),
    }

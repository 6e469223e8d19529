"""Routing replay in the learner's forwards: the model's MoE routers take each position's
experts from the batch's `routes` (`collate`'s layout) instead of their own top-k, keeping their
own probabilities as the weights (`asyncrl.moe`). r3: the routes are the engine's; r2: the ones
the learner's own old-policy pass recorded (`recording_into`), so the update's forwards route
as the forward that gave the ratio's denominator.

Only the policy whose tap `enable` switched on replays: a frozen reference copied from it, or
a critic, routes itself (verl replays in the actor only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from asyncrl import moe


def enable(model: torch.nn.Module) -> moe.Tap:
    """Make `model`'s forwards replay the routes the batch carries (RoutesError when its
    routers are not ones `asyncrl.moe` reproduces)."""
    tap = moe.install(model)
    tap.replay_on = True
    return tap


@contextlib.contextmanager
def replay(model: torch.nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """Inside: `model`'s forward over the batch whose `routes` ([B, T, layers * top_k]) these
    are replays them, when `enable` was called on it; else nothing changes."""
    tap = moe.tap_of(model)
    if routes is None or tap is None or not getattr(tap, "replay_on", False):
        yield
        return
    b, t, width = routes.shape
    if width != tap.layers * tap.top_k:
        raise moe.RoutesError(
            f"routes of {width} ids per position; the policy has {tap.layers} MoE layers, "
            f"top-k {tap.top_k}"
        )
    with tap.replaying(routes.view(b, t, tap.layers, tap.top_k)):
        yield


def replay_metrics(tap: moe.Tap | None) -> dict[str, float]:
    """The share of routed (token, layer) pairs that were replayed, and of those the share whose
    own top-k differs from the replayed experts, since the last call."""
    if tap is None:
        return {}
    s = tap.reset_stats()
    return {
        "learner/router_replayed_frac": s["replayed"] / max(1, s["routed"]),
        "learner/router_differ_frac": s["differ"] / max(1, s["replayed"]),
    }


def empty_routes(
    model: torch.nn.Module, rows: int, width: int, device: torch.device
) -> torch.Tensor:
    """[rows, width, layers * top_k] uint8, `UNROUTED` everywhere: the batch's routes before
    a recording pass fills them (a position it never forwarded routes itself in the replay)."""
    tap = moe.tap_of(model)
    if tap is None:
        raise moe.RoutesError("routes are recorded on a model whose routers are enabled")
    shape = (rows, width, tap.layers * tap.top_k)
    return torch.full(shape, moe.UNROUTED, dtype=torch.uint8, device=device)


@contextlib.contextmanager
def recording_into(
    model: torch.nn.Module, out: torch.Tensor | None, rows: torch.Tensor, first: int
) -> Iterator[None]:
    """Inside: one forward of `model` over the batch's `rows`, its columns from `first` on
    (a `trimmed` chunk); its routes are written into `out` ([B, T, layers * top_k], the batch's
    routes) at those rows and columns. `out` None: nothing is recorded."""
    tap = moe.tap_of(model)
    if out is None or tap is None:
        yield
        return
    with tap.recording_routes():
        yield
        routes = tap.take()  # [rows x width, layers, k], the forward's own flattening
    width = routes.shape[0] // rows.numel()
    idx = rows.to(out.device)
    out[idx, first : first + width] = routes.view(rows.numel(), width, -1).to(out.device)

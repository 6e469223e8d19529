"""Routed experts of the hf engine's requests (`return_routed_experts`, SGLang's field).

A mixture-of-experts model's lanes record, in every forward with a request that asked for
them, the top-k expert ids each position was routed to in each MoE layer (`asyncrl.moe`: the
router's own top-k, nothing changed in the arithmetic; forwards no one asked for copy
nothing). A request that asked for them keeps one row per position it
forwarded, from position 0: its prefill gives the prompt's rows, each decode step the row of
the token it fed. The last sampled token is never fed, so a finished request holds
`prompt + output - 1` rows, as SGLang's reply does.

A request prefilled again (retracted by a pause, then re-admitted with its partial output)
keeps the rows it has: only positions beyond them are taken from the new prefill, so each
position's route is the one the engine used when it first forwarded that position (the one
its following token was sampled with). The reply carries the rows as SGLang does:
`meta_info["routed_experts"]`, base64 of int32 [rows, layers, top_k], row-major.
"""

from __future__ import annotations

import base64

import numpy as np
import torch

from asyncrl import moe
from asyncrl.engine.hf.batch import Seq

#: The /generate field that asks for them, and the reply's meta_info key (SGLang's names).
REQUEST_KEY = "return_routed_experts"
REPLY_KEY = "routed_experts"


def tap_for(model: torch.nn.Module) -> moe.Tap | None:
    """The model's tap (installed now if needed); None for a model without MoE routers this
    can record."""
    if moe.unsupported(model) is not None:
        return None
    return moe.install(model)


def begin(tap: moe.Tap | None, seqs: list[Seq]) -> bool:
    """Before a forward over `seqs`: record its routes iff one of them asked (the answer)."""
    if tap is None:
        return False
    tap.recording = any(s.return_routes for s in seqs)
    return tap.recording


def check(tap: moe.Tap | None, seq: Seq) -> None:
    """ValueError when `seq` asks for routes the model cannot record."""
    if seq.return_routes and tap is None:
        raise ValueError(f"{REQUEST_KEY}: this model has no mixture-of-experts routers to report")


def recorded(seq: Seq) -> int:
    """Positions of `seq` whose routes are kept (from position 0)."""
    return sum(len(part) for part in seq.routes)


def after_prefill(
    tap: moe.Tap, seqs: list[Seq], inverse: list[int], width: int, lengths: list[int]
) -> None:
    """Give each asking request of a prefill its rows past those it has. The forward ran the
    distinct rows (`inverse[i]`: request i's), left-padded to `width`; `lengths[i]`: request
    i's tokens."""
    routes = tap.take().view(-1, width, tap.layers, tap.top_k)
    for seq, row, n in zip(seqs, inverse, lengths, strict=True):
        have = recorded(seq)
        if seq.return_routes and have < n:
            seq.routes.append(routes[row, width - n + have :].clone())


def after_decode(tap: moe.Tap, seqs: list[Seq]) -> None:
    """Each asking request of a decode step gets the row of the token it fed."""
    routes = tap.take().view(len(seqs), tap.layers, tap.top_k)
    for i, seq in enumerate(seqs):
        if seq.return_routes:
            seq.routes.append(routes[i : i + 1].clone())


def reply_field(seq: Seq) -> str:
    """`meta_info["routed_experts"]`: base64 of int32 [rows, layers, top_k] (SGLang's)."""
    rows = torch.cat(seq.routes) if seq.routes else torch.zeros(0, dtype=torch.uint8)
    return base64.b64encode(rows.numpy().astype(np.int32).tobytes()).decode("ascii")

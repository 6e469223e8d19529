"""The hf engine's pinned weight versions: what it keeps before its live weights change.

Pinned requests (asyncrl's extension, `pin_weight_version` on /generate: a held-out evaluation
of one step's weights): only the weights of that version serve them, so a weight update need
not wait for them. Before the live weights change (a pause, a load, a new version), the
requests pinned to the live version move, KV and all, to a kept lane: a copy of the model as
it was (`keep_pinned`), which no update or pause touches and which each step decodes beside
the live lane, until its last request ends, or, with a lease (`pinned_linger_s`, lanes.py),
until none has used it for that long. At most `max_pinned_versions` are kept (past it the
oldest that only a lease keeps goes, else the oldest, whose requests fail). A pin the engine
cannot serve (another version, or the live one while it is being replaced) is refused (400)
or, if that happened while it queued, failed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncrl.engine.hf.batch import Seq
from asyncrl.engine.hf.lanes import Lanes

#: Fails the requests (running in any lane, or waiting) that match, with the message.
FailWhere = Callable[[Callable[[Seq], bool], str], object]


def keep_pinned(lanes: Lanes, waiting: Sequence[Seq], fail: FailWhere) -> None:
    """The live version kept in a lane of its own when a request, running or in `waiting`
    (the engine's queue, which `fail` removes from), is pinned to it, or a lease keeps it;
    no new request is pinned to the live weights until a version is set. Past `max_kept` a
    kept version goes first (`Lanes.evictee`; its requests fail); with none kept at all, the
    requests pinned to the live version fail. Caller holds the engine's `step_lock` and
    `_cond`."""
    live = lanes.live
    lanes.pinnable = False
    if live.version in lanes.kept:  # kept already (a paused update's later buckets)
        return
    pinned = lambda s: s.pin == live.version  # noqa: E731
    rows = [i for i, s in enumerate(live.running) if pinned(s)]
    wanted = rows or any(pinned(s) for s in waiting)
    if not wanted and not lanes.leased(live.version):
        return
    if lanes.max_kept == 0:
        fail(pinned, f"weight version {live.version} replaced (this engine keeps none)")
        return
    while len(lanes.kept) >= lanes.max_kept:
        gone = lanes.evictee(list(waiting))
        why = f"weight version {gone} dropped: {lanes.max_kept} kept at most"
        fail(lambda s, v=gone: s.pin == v, why)
        del lanes.kept[gone]
    lanes.keep_live(rows)

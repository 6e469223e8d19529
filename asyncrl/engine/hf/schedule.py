"""The hf engine's scheduling policy: which waiting requests a step admits and which lanes it
decodes. Pure functions over the engine's state (the engine holds its locks around them).

Order: SGLang's priority scheduling (a larger `priority` first, FIFO within one, retracted
requests at the head of their priority; no aging). Unlike SGLang, work below the default
priority (0, what rollout requests carry; `priority < 0`, held-out evaluation's -1 by default)
is *background* and yields to foreground work (priority >= 0):

- background requests are admitted in a step that runs no foreground row (none running in a
  stepping lane, none admitted by it), at most `BACKGROUND_ADMIT` per step and half the batch
  in all: a foreground request arriving meanwhile waits one short step (never a 256-row
  prefill) and, with a batch of 2 or more, finds room; beside foreground rows a quarter of
  that every `BACKGROUND_EVERY`-th step, slots kept for it even from waiting foreground ones;
- a lane whose rows are all background (an evaluation pinned to a kept weight version) is
  decoded, while foreground rows run, every `BACKGROUND_EVERY`-th step only.

Why: held-out evaluation beside rollout on one engine. Admitted whenever a slot was free, a
500-prompt evaluation filled the batch at once (a 27 ms prefill, then ~5 ms decode steps) and
the next rollout batch, which the learner needed within one learner step, came several times
later: the learner idled at every evaluation. Yielding, evaluation runs in the engine's idle
time (on the CPU default a rollout batch is ~12 ms of a ~40 ms learner step) and rollout keeps
its latency. Background rows already in a lane with foreground ones (admitted before the
foreground work arrived) decode with them: the rows of one lane share one forward.

Never starved: on an engine that foreground work keeps busy, background requests are still
admitted and their lanes decoded every `BACKGROUND_EVERY`-th step.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncrl.engine.hf.batch import Seq
from asyncrl.engine.hf.lanes import Lane, Lanes

#: Requests below this priority are background (SGLang's default priority: rollout's).
FOREGROUND = 0
#: Background requests one step admits at most (bounds that step's prefill).
BACKGROUND_ADMIT = 64
#: While foreground rows run, a background-only lane is decoded every this many steps.
BACKGROUND_EVERY = 4


def admit(
    ready: Sequence[Seq], running: Sequence[Seq], max_batch: int, busy: bool, step: int
) -> list[Seq]:
    """The requests of `ready` (the queue, in order) to admit in step `step` beside `running`
    (every lane's rows), `max_batch` running in all: the highest priority first, queue order
    within one. Background ones: at most half the batch in all (the other half stays free for
    foreground requests to come) and `BACKGROUND_ADMIT` a step when no foreground row runs
    (`busy`: one does in a stepping lane) nor is admitted now; else a quarter of that, every
    `BACKGROUND_EVERY`-th step only (a share, so that none waits forever; with a batch of 1,
    strict priority: none)."""
    n = max_batch - len(running)
    if n <= 0:
        return []
    ordered = sorted(ready, key=lambda s: -s.priority)  # stable: FIFO within a priority
    front = [s for s in ordered if s.priority >= FOREGROUND]
    back = [s for s in ordered if s.priority < FOREGROUND]
    contended = busy or bool(front)
    if contended and step % BACKGROUND_EVERY:
        return front[:n]
    # background holds half the batch at most; a batch of 1 its one slot, when uncontended
    half = max_batch // 2 if contended else max(1, max_batch // 2)
    room = half - sum(s.priority < FOREGROUND for s in running)
    cap = BACKGROUND_ADMIT // 4 if contended else BACKGROUND_ADMIT
    share = max(0, min(n, room, cap, len(back)))  # slots kept from foreground on a shared step
    return front[: n - share] + back[:share]


def due_lanes(lanes: Sequence[Lane], step: int) -> list[Lane]:
    """The lanes to decode this step: all, except that while a lane runs foreground rows,
    background-only lanes only every `BACKGROUND_EVERY`-th step."""
    if step % BACKGROUND_EVERY == 0 or not busy(lanes):
        return list(lanes)
    return [lane for lane in lanes if busy([lane])]


def busy(lanes: Sequence[Lane]) -> bool:
    """Whether a foreground row runs in one of `lanes`."""
    return any(s.priority >= FOREGROUND for lane in lanes for s in lane.running)


def take(
    waiting: Sequence[Seq],
    lanes: Lanes,
    paused: bool,
    running: Sequence[Seq],
    max_batch: int,
    busy: bool,
    step: int,
) -> tuple[list[Seq], list[Seq]]:
    """(the waiting requests `admit` picks to join `running`, the rest of the queue in order);
    while `paused`, only those a kept version serves are ready."""
    queue = list(waiting)
    ready = [s for s in queue if s.pin in lanes.kept] if paused else queue
    picked = admit(ready, running, max_batch, busy, step)
    taken = {id(s) for s in picked}
    return picked, [s for s in queue if id(s) not in taken]


def has_work(lanes: Lanes, waiting: Sequence[Seq], paused: bool, max_batch: int) -> bool:
    """Whether a step has anything to do: a kept lane's rows to decode; while `paused`, a kept
    version's waiting request and a free slot for it; else any waiting or live running row."""
    kept = lanes.kept
    if any(lane.batch is not None for lane in kept.values()):
        return True
    if paused:
        free = sum(len(lane.running) for lane in lanes.all()) < max_batch
        return free and any(s.pin in kept for s in waiting)
    return bool(waiting) or lanes.live.batch is not None

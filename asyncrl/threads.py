"""The run's CPU thread budget: how many torch threads each CPU-bound process gets and which
cores it is pinned to (`plan_threads`, `threads` config), and how a process applies its share.
Nothing here imports torch at module load, so the config CLI stays fast."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's CPU threads set to `threads` (0: unchanged) inside the block, restored after."""
    import torch

    saved = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


# -- CPU thread budget -------------------------------------------------------------------------
# torch gives every process as many intra-op threads as the machine has cores. A run on a small
# CPU box has at least two such processes (the learner and an engine server), so each would run
# its matrix products on every core while the other does too: both slow down. The budget splits
# the usable cores between the CPU-bound processes of the run (learner ranks, local engine
# servers) and, where they fit, pins each to its own cores. Rollout workers and Ray's own
# processes are I/O-bound and are neither budgeted nor pinned.


class ThreadBudgetError(ValueError):
    """A `threads` setting that cannot be honoured on this machine."""


@dataclass(frozen=True)
class ThreadShare:
    """What one process gets: `threads` torch intra-op threads (0: torch's default, not
    budgeted) and the `cpus` it is pinned to (empty: not pinned)."""

    threads: int = 0
    cpus: tuple[int, ...] = ()

    def args(self) -> list[str]:
        """The hf engine server's command-line arguments for this share."""
        out = ["--num-threads", str(self.threads)] if self.threads > 0 else []
        return out + (["--cpus", ",".join(map(str, self.cpus))] if self.cpus else [])


@dataclass(frozen=True)
class ThreadBudget:
    """One share per learner rank (rank 0 is the driver) and one per local engine server."""

    learner: tuple[ThreadShare, ...]
    engines: tuple[ThreadShare, ...]
    cores: int
    note: str = ""
    """Why some processes are not pinned (empty when every budgeted one is)."""

    def describe(self) -> str:
        """One line for the run's log."""

        def part(name: str, shares: tuple[ThreadShare, ...]) -> str:
            if not shares:
                return f"{name}: none local"
            counts = sorted({s.threads for s in shares if s.threads}, reverse=True)
            what = "/".join(map(str, counts)) + " thread(s)" if counts else "torch default"
            if counts and not all(s.threads for s in shares):
                what += " (the rest: torch default)"
            pins = "; ".join(",".join(map(str, x.cpus)) for x in shares if x.cpus)
            return f"{len(shares)} {name} x {what}" + (f" on cpus [{pins}]" if pins else "")

        text = f"{part('learner', self.learner)}, {part('engine', self.engines)} on {self.cores}"
        return (
            text
            + " usable cores; rollout workers unbudgeted"
            + (f" ({self.note})" if self.note else "")
        )


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity mask: a container's or taskset's cpu
    set, not the machine's count)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: every core
        return list(range(os.cpu_count() or 1))


def _explicit(name: str, value: int | str, cores: int) -> int | None:
    """An explicit thread count (checked), or None for auto."""
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ThreadBudgetError(f"threads.{name} must be auto or an integer >= 1, got {value!r}")
    if value > cores:
        raise ThreadBudgetError(
            f"threads.{name} {value} exceeds the {cores} usable cores of this machine"
        )
    return value


def _auto_counts(cores: int, ranks: int, engines: int, fixed: dict[str, int | None]) -> list[int]:
    """Threads per process (ranks first, then engines): explicit roles keep their counts, the
    auto ones share what is left evenly, at least 1 each. Leftover cores go to the learner
    ranks when every rank can have one (the learner's step is the loop's critical path, and
    FSDP ranks wait for the slowest), else one each to engines; any still left stay free."""
    roles = ["learner"] * ranks + ["engine"] * engines
    counts = [fixed[r] or 0 for r in roles]
    auto = [i for i, r in enumerate(roles) if fixed[r] is None]
    if not auto:
        return counts
    base, extra = divmod(max(0, cores - sum(counts)), len(auto))
    auto_ranks = [i for i in auto if roles[i] == "learner"]
    bonus = auto_ranks if auto_ranks and extra >= len(auto_ranks) else []
    bonus += [i for i in auto if roles[i] == "engine"][: extra - len(bonus)]
    for i in auto:
        counts[i] = max(1, base + (i in bonus))
    return counts


def plan_threads(
    cores: Sequence[int],
    ranks: int,
    engines: int,
    learner: int | str = "auto",
    engine: int | str = "auto",
    pin: bool = True,
    learner_on_cpu: bool = True,
) -> ThreadBudget:
    """The run's thread budget on `cores` (the usable core ids) for `ranks` learner processes
    and `engines` local CPU engine servers. `auto` splits the cores between the CPU-bound
    processes; an integer is that many threads per process of the role. A learner on an
    accelerator is not budgeted under auto (its CPU threads feed the device, and taking them
    would starve it). `pin`: each budgeted process on cores of its own, when they all fit;
    otherwise none is pinned and `note` says why. Raises ThreadBudgetError for a count below 1
    or above the cores."""
    n = len(cores)
    fixed = {"learner": _explicit("learner", learner, n), "engine": _explicit("engine", engine, n)}
    cpu_ranks = ranks if learner_on_cpu or fixed["learner"] is not None else 0
    counts = _auto_counts(n, cpu_ranks, engines, fixed)
    note = ""
    if not pin:
        note = "pinning off"
    elif not hasattr(os, "sched_setaffinity"):
        note = "this OS cannot pin threads"
    elif sum(counts) > n:
        note = f"{sum(counts)} threads on {n} cores: oversubscribed, not pinned"
    placed: list[tuple[int, ...]] = []
    start = 0
    for c in counts:
        placed.append(tuple(cores[start : start + c]) if pin and not note else ())
        start += c
    shares = [ThreadShare(c, cpus) for c, cpus in zip(counts, placed)]
    if not learner_on_cpu and fixed["learner"] is not None:  # set, never pinned off the CPU
        shares[:cpu_ranks] = [ThreadShare(c) for c in counts[:cpu_ranks]]
    learners = tuple(shares[:cpu_ranks]) or tuple(ThreadShare() for _ in range(ranks))
    return ThreadBudget(learners, tuple(shares[cpu_ranks:]), n, note)


def apply_thread_share(share: ThreadShare, whole_process: bool = False) -> None:
    """Give this process its share for good (a process started for it: an engine server, a
    learner rank): torch's intra-op threads, inter-op to 1 (where torch still allows it: it
    refuses once inter-op work ran), and its cpus (`pin_threads`)."""
    import torch

    if share.threads > 0:
        torch.set_num_threads(share.threads)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
    if share.cpus:
        pin_threads(share.cpus, whole_process)


def pin_threads(cpus: Sequence[int], whole_process: bool = False) -> None:
    """Pin to `cpus`: every thread this process has now when `whole_process`, else the calling
    thread (on Linux an affinity belongs to a thread; a new thread or child process inherits
    its creator's)."""
    tids = [0]
    if whole_process and os.path.isdir("/proc/self/task"):
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)


class DriverThreads:
    """The driver's share (it is learner rank 0): torch's threads from `__enter__`, every
    thread pinned from `pin()` -- called once the run's other processes are started, since a
    child inherits its creator's pinning (Ray's processes, the rollout workers: never pinned)
    -- and both restored at exit: the process may outlive the run (tests, a notebook), and a
    next run measures the usable cores afresh. Inter-op threads are left alone (torch allows
    setting them once per process)."""

    def __init__(self, share: ThreadShare) -> None:
        self.share = share
        self._saved: tuple[int, list[int]] | None = None
        self._pinned = False

    def __enter__(self) -> DriverThreads:
        import torch

        self._saved = (torch.get_num_threads(), usable_cores())
        if self.share.threads > 0:
            torch.set_num_threads(self.share.threads)
        return self

    def pin(self) -> None:
        if self.share.cpus and not self._pinned:
            pin_threads(self.share.cpus, whole_process=True)
            self._pinned = True

    def __exit__(self, *exc: object) -> None:
        import torch

        assert self._saved is not None, "DriverThreads used outside `with`"
        torch.set_num_threads(self._saved[0])
        if self._pinned:
            pin_threads(self._saved[1], whole_process=True)
            self._pinned = False

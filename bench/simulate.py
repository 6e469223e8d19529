"""Cluster simulation: the real orchestration driven by simulated engines and a simulated learner.

Real: the `ReplayQueue` (admission with the in-flight ledger, staleness eviction), the
`Dispatcher` (per-actor in-flight slots, re-issues), the codec and the ZMQ transport (one `Sender` per actor,
one `Receiver`, a pump into the queue, as `run.py` starts them). Simulated: engines and
learner. Each of 8 ... 1,024 actors (asyncio tasks, no Ray) generates up to `--inflight` prompts
at a time; a group of n responses takes ttft + max(response length) x tpot, lengths drawn from
a long-tailed log-normal; the finished group (real arrays, tagged with the policy version
current when it started) is encoded and sent over ZMQ. The learner takes a batch, "trains" for
tokens / learner tokens/s + the weight-sync time, bumps the version. Time runs `--speedup`
times faster than the modelled cluster, so the orchestration gets `--speedup` times its real
load; it must still keep up.

Reported per actor count: learner utilisation (busy / wall after warm-up), groups evicted as
too stale, and the orchestration CPU per trajectory (this process's CPU time per delivered
response: dispatch, simulated actors, encode, send, receive, decode, queue; nothing else runs
here). Targets at the largest count (1,024): utilisation >= 95 %, orchestration < 1 ms per trajectory.

Default calibration (a 7B-class model): SGLang decode 25 ms/token per sequence, 0.2 s to first
token; responses log-normal with median 1k tokens, sigma 0.7, at most 4k; a learner at 16k
tokens/s and a 2 s weight sync (a step of 64 prompts x 8 responses takes ~45 s, so the
slowest group, ~100 s, fits in the staleness window of max_staleness 4 steps).

    asyncrl bench simulate [--smoke] [--actors 8,32,128,256,512,1024] [--speedup 100]
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from common import finish, headline, make_parser, print_table

from asyncrl.data.prompts import PromptItem
from asyncrl.orchestrator import GroupPump
from asyncrl.replay.queue import ReplayConfig, ReplayQueue
from asyncrl.rollout.dispatch import Dispatcher
from asyncrl.rollout.settings import PromptResult
from asyncrl.transport.sender import Sender, SenderConfig
from asyncrl.transport.zmq import Receiver, ReceiverConfig
from asyncrl.types import TrajectoryGroup

TARGET_UTIL, TARGET_MS = 0.95, 1.0
#: `run_cluster`'s per-step hook: the batch the learner trained and its version then.
Observe = Callable[[list[TrajectoryGroup], int], None]
POOL = 1 << 20  # pre-drawn random tokens / logprobs, sliced into responses


@dataclass
class Calibration:
    ttft_s: float = 0.2
    tpot_s: float = 0.025
    median_len: int = 1024
    sigma: float = 0.7
    max_len: int = 4096
    prompt_len: int = 256
    learner_tokens_per_s: float = 16_000.0
    sync_s: float = 2.0


@dataclass
class Workload:
    batch: int = 64
    n: int = 8
    max_staleness: int = 4
    inflight: int = 2
    steps: int = 40
    warmup: int = 8
    speedup: float = 100.0
    max_wall_s: float = 25.0


class SimPool:
    """The dispatcher's `WorkerPool`: simulated actors as tasks on one event-loop thread."""

    def __init__(
        self, actors: int, cal: Calibration, work: Workload, port: int, seed: int, secret: bytes
    ) -> None:
        self.actors, self.cal, self.work = actors, cal, work
        self.version = 0  # the learner's; a group is tagged with it when it starts
        self.done: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        rng = np.random.default_rng(seed)
        self._rng = rng
        self._tokens = rng.integers(0, 150_000, POOL, dtype=np.int32)
        self._logprobs = -rng.exponential(1.0, POOL).astype(np.float32)
        self._ctx = zmq.Context()
        # Real actors each own a process and a context; here one context holds every actor's
        # socket, past ZMQ's default cap of 1023 sockets per context.
        self._ctx.set(zmq.MAX_SOCKETS, actors + 64)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="sim")
        self.thread.start()
        config = SenderConfig(port=port, hwm=1024, send_timeout_s=60.0, secret=secret)
        make = lambda: [Sender(config, self._ctx) for _ in range(actors)]  # noqa: E731
        self.senders = asyncio.run_coroutine_threadsafe(_call(make), self.loop).result(120)

    def size(self) -> int:
        return self.actors

    def submit(self, actor: int, items: list[PromptItem]) -> int:
        handle = next(self._ids)
        coro = self._run(actor, handle, items, self.version)
        self.loop.call_soon_threadsafe(self.loop.create_task, coro)
        return handle

    def wake(self) -> None:
        self.done.put(None)  # ends a poll's wait; not a result

    def poll(self, timeout: float) -> list[tuple[int, Any, list[PromptResult]]]:
        try:
            out = [self.done.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.done.get_nowait())
            except queue.Empty:
                return [x for x in out if x is not None]

    async def _run(self, actor: int, handle: int, items: list[PromptItem], version: int):
        results = await asyncio.gather(*(self._one(actor, it, version) for it in items))
        self.done.put((actor, handle, list(results)))

    async def _one(self, actor: int, item: PromptItem, version: int) -> PromptResult:
        cal = self.cal
        lengths = np.exp(self._rng.normal(np.log(cal.median_len), cal.sigma, self.work.n))
        lengths = np.clip(lengths, 1, cal.max_len).astype(np.int32)
        await asyncio.sleep((cal.ttft_s + int(lengths.max()) * cal.tpot_s) / self.work.speedup)
        group = self._group(item.key, lengths, version)
        self.senders[actor].send(group)
        return PromptResult(item.key, ok=True, tokens=group.num_tokens)

    def _group(self, key: str, lengths: np.ndarray, version: int) -> TrajectoryGroup:
        total, n = int(lengths.sum()), len(lengths)
        start = int(self._rng.integers(0, POOL - total))
        rewards = self._rng.random(n).astype(np.float32)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        return TrajectoryGroup(
            group_id=key, prompt_ids=self._tokens[: self.cal.prompt_len],
            response_lengths=lengths, response_ids=self._tokens[start : start + total],
            rollout_logprobs=self._logprobs[start : start + total],
            loss_mask=np.ones(total, np.uint8), versions=np.full(total, version, np.int32),
            rewards=rewards, finish_reasons=["stop"] * n,
            advantages=np.repeat(adv.astype(np.float32), lengths),
            metadata={"prompt_key": key},
        )  # fmt: skip

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self._ctx.term()

    async def _shutdown(self) -> None:
        """Cancel the generations still running, then close the senders (on their thread)."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sender in self.senders:
            sender.close()


async def _call(fn):
    return fn()


def _thread_cpu(native_ids: dict[str, int]) -> dict[str, float]:
    """CPU seconds of named threads of this process (Linux), plus the whole process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"process": time.process_time()}
    for name, tid in native_ids.items():
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            out[name] = 0.0
    return out


def simulate(actors: int, cal: Calibration, work: Workload, seed: int = 0) -> dict[str, Any]:
    replay = ReplayQueue(ReplayConfig(work.max_staleness, work.batch))
    steps = run_cluster(replay, actors, cal, work, seed)
    return _summarise(actors, steps, replay.metrics(), work)


def run_cluster(
    replay: ReplayQueue,
    actors: int,
    cal: Calibration,
    work: Workload,
    seed: int = 0,
    observe: Observe | None = None,
    prompt_ids: list[int] | None = None,
) -> list[dict[str, Any]]:
    """The real queue, dispatcher, transport and pump around `actors` simulated engines and a
    simulated learner; one record per learner step (stopped early at `work.max_wall_s`).
    `observe(groups, version)`: called with each batch as the learner trains it (the adaptive
    bound's hook); `prompt_ids`: what each prompt carries (default one token; a token budget
    charges admitted prompts by their length)."""
    secret = secrets.token_bytes(32)  # as a run: every actor's connection proves it (PLAIN)
    receiver = Receiver(ReceiverConfig(hwm=1024, secret=secret))
    pool = SimPool(actors, cal, work, receiver.port, seed, secret)
    counter, ids = itertools.count(), prompt_ids or [0]
    next_prompt = lambda: PromptItem(key=f"p{next(counter)}", prompt_ids=ids)  # noqa: E731
    dispatcher = Dispatcher(pool, replay, next_prompt, work.inflight)
    pump = GroupPump(receiver, replay).__enter__()  # the run's own pump thread
    dispatcher.start()
    # the pump thread also receives and decodes: Receiver.get does both in its caller's thread
    threads = {"dispatcher": dispatcher._thread.native_id, "pump": pump._thread.native_id,
               "actors": pool.thread.native_id, "learner": threading.get_native_id()}  # fmt: skip
    try:
        return _learn(replay, pool, dispatcher, receiver, cal, work, threads, observe)
    finally:
        replay.close()
        dispatcher.stop()
        pool.close()
        pump.__exit__()
        receiver.close()


def _learn(
    replay, pool, dispatcher, receiver, cal, work, threads, observe=None
) -> list[dict[str, Any]]:
    """The simulated learner: take (timed: its idle), 'train' for tokens / its speed + the
    sync (sleep), bump the version. One record per step."""
    steps, version, began = [], 0, time.perf_counter()
    while len(steps) < work.steps and time.perf_counter() - began < work.max_wall_s:
        start, groups = time.perf_counter(), None
        while groups is None and time.perf_counter() - began < work.max_wall_s:
            dispatcher.check()
            groups = replay.take(work.batch, version, timeout=0.5)
        if groups is None:
            break
        got = time.perf_counter()
        tokens = sum(g.num_tokens for g in groups)
        time.sleep((tokens / cal.learner_tokens_per_s + cal.sync_s) / work.speedup)
        if observe is not None:
            observe(groups, version)
        version += 1
        pool.version = version
        replay.set_version(version)
        end = time.perf_counter()
        steps.append({"start": start, "got": got, "end": end, "tokens": tokens,
                      "cpu": _thread_cpu(threads), "received": receiver.stats().received})  # fmt: skip
    return steps


def _summarise(actors: int, steps: list[dict], qm: dict, work: Workload) -> dict[str, Any]:
    warm = max(1, min(work.warmup, len(steps) // 3))
    first, window = steps[warm - 1], steps[warm:]
    if not window:
        raise RuntimeError(f"{actors} actors: only {len(steps)} steps in {work.max_wall_s}s")
    wall = window[-1]["end"] - first["end"]
    busy = sum(s["end"] - s["got"] for s in window)
    groups = window[-1]["received"] - first["received"]
    cpu = {k: v - first["cpu"][k] for k, v in window[-1]["cpu"].items()}
    trajectories = max(1, groups * work.n)
    return {
        "actors": actors,
        "steps_measured": len(window),
        "learner_utilisation": busy / wall,
        "groups_delivered": groups,
        "groups_per_s_wall": groups / wall,
        "trajectories_per_s_sim": groups * work.n / wall / work.speedup,
        "orchestration_ms_per_trajectory": 1e3 * cpu["process"] / trajectories,
        "orchestration_ms_per_group": 1e3 * cpu["process"] / max(1, groups),
        "cpu_ms_per_trajectory_by_thread": {k: 1e3 * v / trajectories for k, v in cpu.items()},
        "cpu_cores_used": cpu["process"] / wall,
        "evicted": qm["evicted"],
        "staleness_mean": qm["lag_taken_mean"],
    }


def _plot(rows: list[dict]):
    def draw(fig: Any) -> None:
        left, right = fig.subplots(1, 2)
        xs = [r["actors"] for r in rows]
        left.plot(xs, [100 * r["learner_utilisation"] for r in rows], "o-")
        left.axhline(100 * TARGET_UTIL, ls="--", c="k", label="target")
        left.set(xscale="log", xlabel="rollout actors", ylabel="learner utilisation %")
        left.legend()
        right.plot(xs, [r["orchestration_ms_per_trajectory"] for r in rows], "o-")
        right.axhline(TARGET_MS, ls="--", c="k", label="target")
        right.set(xscale="log", yscale="log", xlabel="rollout actors", ylabel="CPU ms / trajectory")
        right.legend()

    return draw


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--actors", default=None, help="comma-separated actor counts")
    parser.add_argument("--speedup", type=float, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--max-wall-s", type=float, default=None, help="per actor count")
    args = parser.parse_args(argv)
    counts = [int(v) for v in (args.actors or ("8,32" if args.smoke else "8,32,128,256,512,1024")).split(",")]  # fmt: skip
    cal = Calibration()
    work = Workload(batch=16, steps=8, warmup=3, max_wall_s=4.0) if args.smoke else Workload()
    work.speedup = args.speedup or work.speedup
    work.steps = args.steps or work.steps
    work.max_wall_s = args.max_wall_s or work.max_wall_s
    rows = []
    for count in counts:
        rows.append(simulate(count, cal, work))
    _table(rows)
    top = rows[-1]
    met = {"utilisation": top["learner_utilisation"] >= TARGET_UTIL,
           "orchestration_ms": top["orchestration_ms_per_trajectory"] < TARGET_MS}  # fmt: skip
    result = {
        "calibration": asdict(cal), "workload": asdict(work), "rows": rows,
        "target": {"utilisation": TARGET_UTIL, "orchestration_ms": TARGET_MS, "at_actors": top["actors"]},
        "met": met,
        "headline": {
            "utilisation_at_max_actors": headline(top["learner_utilisation"], True, ""),
            "orchestration_ms_per_trajectory": headline(top["orchestration_ms_per_trajectory"], False, "ms"),
        },
    }  # fmt: skip
    print(f"\nat {top['actors']} actors: utilisation {100 * top['learner_utilisation']:.1f}% "
          f"(target {100 * TARGET_UTIL:.0f}%: {'met' if met['utilisation'] else 'MISSED'}), "
          f"orchestration {top['orchestration_ms_per_trajectory']:.3f} ms/trajectory "
          f"(target < {TARGET_MS} ms: {'met' if met['orchestration_ms'] else 'MISSED'})")  # fmt: skip
    return finish("simulate", result, args, _plot(rows), argv)


def _table(rows: list[dict]) -> None:
    print_table(
        "simulated cluster, real queue + dispatcher + codec + ZMQ",
        ["actors", "util %", "groups/s (wall)", "traj/s (sim)", "ms/traj", "ms/group",
         "cores", "evicted", "staleness"],
        [[r["actors"], 100 * r["learner_utilisation"], r["groups_per_s_wall"],
          r["trajectories_per_s_sim"], r["orchestration_ms_per_trajectory"],
          r["orchestration_ms_per_group"], r["cpu_cores_used"], r["evicted"],
          r["staleness_mean"]] for r in rows],
    )  # fmt: skip
    by_thread = {r["actors"]: r["cpu_ms_per_trajectory_by_thread"] for r in rows}
    names = [k for k in next(iter(by_thread.values())) if k != "process"]
    print_table(
        "CPU ms per trajectory by thread (rest: ZMQ I/O and other threads)",
        ["actors", *names, "process"],
        [[a, *(t[k] for k in names), t["process"]] for a, t in by_thread.items()],
    )


if __name__ == "__main__":
    raise SystemExit(main())

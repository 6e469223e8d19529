"""End to end: async vs sync training throughput on the same workload, in one run.

Both runs are the real loop (`asyncrl.run.run`: Ray rollout actors, an hf engine server, ZMQ,
the replay queue, the torch learner, gloo weight sync) on the same tiny model, prompts and
seeds; only `async.max_staleness` differs (0 = synchronous, the default 1 = async). The engine
and the learner get the run's thread budget (`threads`, auto: on a 2-core box one core each,
pinned), as disjoint GPU pools would get their own devices, so generation and training can
overlap; `--threads N` sets N torch threads for each instead.

From the sync run's steady-state steps (the first `--warmup` are dropped):
  T_gen   = the learner's wait for a batch (generation with the newest weights),
  T_train = the rest of the step (learner update + weight sync + bookkeeping),
  bound   = (T_gen + T_train) / max(T_gen, T_train): the speedup a perfect overlap gives.
Measured speedup = async trained tokens/s / sync trained tokens/s. Targets (issue 16): >= 0.95 x
bound, and the async run's learner idle <= 10 %.
`--rounds` pairs run in alternating order (sync, async, async, sync, ...); the medians count.
Learner idle % = time waiting for a batch / wall time; rollout idle % = 1 - engine process
CPU time / wall time (the engine computes on one thread; idle it sleeps). Every run's
metrics.jsonl is kept under `<out>/e2e_runs/`.

    asyncrl bench e2e [--smoke] [--rounds 3] [--steps 12] [--warmup 3] [--staleness 1]
                      [--threads auto|N] [--set key=value ...]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import build_model_dir, finish, headline, make_parser, out_dir, print_table

TARGET = 0.95
IDLE_TARGET_PCT = 10.0  # the async run's learner idle
FULL = dict(
    model=dict(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4),
    steps=12, warmup=3, overrides=["rollout_batch_size=4", "num_return_sequences_in_group=8",
                                   "response_length=64", "rollout.max_inflight_prompts=8",
                                   "actor_train.training_args.per_device_train_batch_size=16",
                                   "actor_train.infer_batch_size=16"],
)  # fmt: skip
SMOKE = dict(
    model=dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4),
    steps=3, warmup=1, overrides=["rollout_batch_size=2", "num_return_sequences_in_group=3",
                                  "response_length=6", "rollout.max_inflight_prompts=2"],
)  # fmt: skip


class EngineCPU:
    """Samples the engine servers' CPU seconds and the metrics file's row count every 50 ms,
    so engine busy time can be cut to the same steps as the learner's numbers."""

    def __init__(self, metrics: Path) -> None:
        self.metrics, self.samples = metrics, []  # (perf_counter, engine cpu s, rows)
        self._pids: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="bench-engine-cpu")

    def __enter__(self) -> EngineCPU:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(0.05):
            if not self._pids:
                self._pids = _engine_pids()
            cpu = sum(_cpu_ticks(p) for p in self._pids) / tick
            rows = _count_lines(self.metrics)
            self.samples.append((time.perf_counter(), cpu, rows))

    def busy_fraction(self, rows_from: int, rows_to: int) -> float | None:
        """Engine CPU / wall between the samples that first saw `rows_from` and `rows_to` rows."""
        first = next((s for s in self.samples if s[2] >= rows_from), None)
        last = next((s for s in self.samples if s[2] >= rows_to), None)
        if first is None or last is None or last[0] <= first[0]:
            return None
        return (last[1] - first[1]) / (last[0] - first[0])


def _engine_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # fields after the name: state, ppid, ...; only this process's own engines count
            if b"asyncrl.engine.hf.server" in cmd and int(stat[1]) == os.getpid():
                pids.append(int(entry.name))
    return pids


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14, 15 of stat)


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def run_once(model_dir: Path, out: Path, staleness: int, sizes: dict, seed: int) -> dict:
    from asyncrl.config import load_config
    from asyncrl.run import run

    cfg = load_config(None, [
        f"actor_train.model_args.model_name_or_path={model_dir}", f"output_dir={out}",
        f"max_steps={sizes['steps']}", f"async.max_staleness={staleness}", f"seed={seed}",
        "rollout.num_actors=2", "logging.eval_interval=0", "logging.console=false",
        "logging.tensorboard=false", "actor.checkpoint.save_contents=[]",
        "actor_train.model_args.disable_gradient_checkpointing=true",
        *sizes["overrides"],
    ])  # fmt: skip
    load = os.getloadavg()[0]  # the box's load beside the figures (others may share it)
    with EngineCPU(out / "metrics.jsonl") as sampler:
        run(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    load_1m = (load + os.getloadavg()[0]) / 2
    return {**analyse(rows, sampler, sizes["warmup"], cfg.rollout_batch_size), "load_1m": load_1m}


def analyse(rows: list[dict], sampler: EngineCPU, warmup: int, batch: int) -> dict[str, Any]:
    steps = sorted((r for r in rows if r["step"] >= 1), key=lambda r: r["step"])
    first = steps[0]  # the run's start-up: time to its first trained batch, thread budget
    start = next(r for r in steps if r["step"] == warmup)
    window = [r for r in steps if r["step"] > warmup]
    wall = window[-1]["time"] - start["time"]
    times = [start["time"]] + [r["time"] for r in window]
    elapsed = [b - a for a, b in zip(times, times[1:])]
    waits = [r["learner/wait_seconds"] for r in window]
    busy = sampler.busy_fraction(warmup + 1, window[-1]["step"] + 1)
    return {
        "steps_measured": len(window),
        "wall_s": wall,
        "tokens_per_s": sum(r["learner/tokens"] for r in window) / wall,
        "groups_per_s": batch * len(window) / wall,
        "step_s": statistics.median(elapsed),
        "t_gen_s": statistics.median(waits),
        "t_train_s": statistics.median(e - w for e, w in zip(elapsed, waits)),
        "learner_update_s": statistics.median(r["learner/step_seconds"] for r in window),
        "sync_s": statistics.median(r.get("sync/seconds", 0.0) for r in window),
        "learner_idle_pct": 100 * sum(waits) / wall,
        "rollout_idle_pct": None if busy is None else 100 * max(0.0, 1 - busy),
        "staleness_mean": statistics.fmean(r["replay/staleness_mean"] for r in window),
        "first_batch_s": first.get("time/first_batch_s"),
        "threads_learner": first.get("threads/learner"),
        "threads_engine": first.get("threads/engine"),
    }


def compare(sync: dict, asyn: dict) -> dict[str, float]:
    t_gen, t_train = sync["t_gen_s"], sync["t_train_s"]
    bound = (t_gen + t_train) / max(t_gen, t_train)
    speedup = asyn["tokens_per_s"] / sync["tokens_per_s"]
    return {"bound": bound, "speedup": speedup, "of_bound": speedup / bound}


def _plot(runs: dict[str, dict], ratio: dict[str, float]):
    def draw(fig: Any) -> None:
        left, right = fig.subplots(1, 2)
        names = list(runs)
        left.bar(names, [runs[n]["tokens_per_s"] for n in names])
        left.axhline(runs["sync"]["tokens_per_s"] * ratio["bound"], ls="--", c="k",
                     label=f"overlap bound ({ratio['bound']:.2f}x sync)")  # fmt: skip
        left.set_ylabel("trained tokens / s")
        left.legend()
        for key, label in (("learner_idle_pct", "learner idle %"), ("rollout_idle_pct", "rollout idle %")):  # fmt: skip
            right.plot(names, [runs[n][key] or 0 for n in names], "o-", label=label)
        right.set_ylabel("%")
        right.legend()

    return draw


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="sync+async pairs (median)")
    parser.add_argument("--staleness", type=int, default=1, help="of the async run (>= 1)")
    parser.add_argument("--threads", default="auto", help="torch threads per process (auto)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], help="extra config overrides k=v")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA vs full FT instead")
    args = parser.parse_args(argv)
    sizes = dict(SMOKE if args.smoke else FULL)
    sizes["overrides"] = [*sizes["overrides"], *args.set]
    sizes["steps"] = args.steps or sizes["steps"]
    sizes["warmup"] = args.warmup if args.warmup is not None else sizes["warmup"]
    if args.lora_rank > 0:
        return lora_vs_full(sizes, args, argv)
    rounds = _rounds(sizes, args, args.rounds or (1 if args.smoke else 3))
    ratios = [compare(r["sync"], r["async"]) for r in rounds]
    ratio = {k: statistics.median(x[k] for x in ratios) for k in ratios[0]}
    runs = {m: _median_run([r[m] for r in rounds]) for m in ("sync", "async")}
    _print(rounds, ratios, ratio, args.staleness)
    met = {
        "of_bound": ratio["of_bound"] >= TARGET,
        "async_learner_idle": runs["async"]["learner_idle_pct"] <= IDLE_TARGET_PCT,
    }
    idle = runs["async"]["learner_idle_pct"]
    print(f"async learner idle {idle:.1f} % (target <= {IDLE_TARGET_PCT:g}: "
          f"{'met' if met['async_learner_idle'] else 'MISSED'})")  # fmt: skip
    result = {
        "staleness": args.staleness, "threads": args.threads, "sizes": sizes, "runs": runs,
        "rounds": [{**r, **x} for r, x in zip(rounds, ratios)], **ratio,
        "target": {"of_bound": TARGET, "async_learner_idle_pct": IDLE_TARGET_PCT}, "met": met,
        "headline": {
            "of_bound": headline(ratio["of_bound"], True, "x"),
            "async_tokens_per_s": headline(runs["async"]["tokens_per_s"], True, "tok/s"),
            "sync_tokens_per_s": headline(runs["sync"]["tokens_per_s"], True, "tok/s"),
        },
    }  # fmt: skip
    return finish("e2e", result, args, _plot(runs, ratio), argv)


def _median_run(runs: list[dict]) -> dict[str, Any]:
    return {
        k: None if any(r[k] is None for r in runs) else statistics.median(r[k] for r in runs)
        for k in runs[0]
    }


def _rounds(sizes: dict, args: Any, rounds: int) -> list[dict[str, dict]]:
    """sync, async, async, sync, ... in one process (Ray starts once): the order alternates so
    drift in the machine's load and first-run effects hit both alike. `--threads N`: the
    learner and the engine N torch threads each (the run's budget applies them)."""
    saved_env = os.environ.get("OMP_NUM_THREADS")
    if args.threads != "auto":
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the Ray workers' torch too
        sizes = {**sizes, "overrides": [*sizes["overrides"], f"threads.learner={args.threads}",
                                        f"threads.engine={args.threads}"]}  # fmt: skip
    modes = (("sync", 0), ("async", args.staleness))
    runs = out_dir(args) / "e2e_runs"  # each run's metrics.jsonl stays for inspection
    shutil.rmtree(runs, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(prefix="asyncrl-bench-e2e-") as tmp:
            model_dir = build_model_dir(Path(tmp) / "model", **sizes["model"])
            return [
                {
                    m: run_once(model_dir, runs / f"{m}{i + 1}", k, sizes, args.seed)
                    for m, k in (modes if i % 2 == 0 else modes[::-1])
                }
                for i in range(rounds)
            ]
    finally:
        if saved_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_env


def _print(rounds: list[dict], ratios: list[dict], ratio: dict, staleness: int) -> None:
    keys = ["tokens_per_s", "step_s", "t_gen_s", "t_train_s", "learner_update_s", "sync_s",
            "learner_idle_pct", "rollout_idle_pct", "staleness_mean", "first_batch_s",
            "load_1m"]  # fmt: skip
    print_table(
        f"async (max_staleness {staleness}) vs sync (max_staleness 0), steady-state steps",
        ["run", *keys, "bound", "async/sync", "of bound"],
        [[f"{m} #{i + 1}", *(r[m][k] for k in keys), *((x["bound"], x["speedup"], x["of_bound"])
          if m == "async" else (None,) * 3)]
         for i, (r, x) in enumerate(zip(rounds, ratios)) for m in ("sync", "async")],
    )  # fmt: skip
    print(
        f"\nmedian over {len(rounds)} round(s): overlap bound (T_gen + T_train) / max = "
        f"{ratio['bound']:.3f}x; measured async/sync = {ratio['speedup']:.3f}x = "
        f"{ratio['of_bound']:.3f} of the bound "
        f"(target >= {TARGET}: {'met' if ratio['of_bound'] >= TARGET else 'MISSED'})"
    )


def lora_vs_full(sizes: dict, args: Any, argv: list[str] | None) -> int:
    """`--lora-rank N` (issue 17): the async run (`--staleness`) with full fine-tuning and with a
    rank-N adapter (`lora_sync: auto`: adapter-only syncs to the hf engine), same model, workload
    and seed: trained tokens/s, seconds and bytes per sync, steady-state medians."""
    runs_dir = out_dir(args) / "e2e_lora_runs"  # each run's metrics.jsonl stays for inspection
    shutil.rmtree(runs_dir, ignore_errors=True)
    lora = [f"actor_train.model_args.lora_rank={args.lora_rank}"]
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-e2e-lora-") as tmp:
        model_dir = build_model_dir(Path(tmp) / "model", **sizes["model"])
        for name, extra in (("full", []), ("lora", lora)):
            out, run_sizes = runs_dir / name, {**sizes, "overrides": [*sizes["overrides"], *extra]}
            row = run_once(model_dir, out, args.staleness, run_sizes, args.seed)
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            steady = [r for r in rows if r.get("step", 0) > sizes["warmup"]]
            sent = [r["sync/bytes"] for r in steady if r.get("sync/bytes") is not None]
            runs[name] = {**row, "sync_bytes": statistics.median(sent) if sent else None}
    keys = ["tokens_per_s", "step_s", "learner_update_s", "sync_s", "sync_bytes"]
    title = f"full fine-tuning vs LoRA rank {args.lora_rank} (async, staleness {args.staleness})"
    print_table(title, ["run", *keys], [[n, *(r[k] for k in keys)] for n, r in runs.items()])
    result = {
        "lora_rank": args.lora_rank, "staleness": args.staleness, "sizes": sizes, "runs": runs,
        "headline": {
            "lora_tokens_per_s": headline(runs["lora"]["tokens_per_s"], True, "tok/s"),
            "lora_sync_bytes": headline(runs["lora"]["sync_bytes"] or 0.0, False, "B"),
        },
    }  # fmt: skip
    return finish("e2e_lora", result, args, None, argv)


if __name__ == "__main__":
    raise SystemExit(main())

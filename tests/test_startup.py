"""The run's start-up order (startup.py): the engines and the rollout workers start before the
learner is built, so a failure in between must still stop them; SIGTERM ends a run (the CLI's,
or one started from Python) as Ctrl-C does (every started process stopped, the rows so far
kept); the learner closes after the engines stop."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import asyncrl.run as run_module
from asyncrl.engine.fleet import EngineFleet
from asyncrl.startup import WorkerStart
from tests.helpers import descendants, running, wait_for
from tests.test_e2e import shrunk, shrunk_overrides

ROOT = Path(__file__).resolve().parents[1]


def spy_on_the_fleet(monkeypatch, seen: dict[str, object]) -> None:
    """`seen["fleet"]`: the run's EngineFleet, recorded as it spawns its engines."""
    spawn = EngineFleet.spawn

    def spy_spawn(fleet, *args, **kwargs):
        seen["fleet"] = fleet
        return spawn(fleet, *args, **kwargs)

    monkeypatch.setattr(EngineFleet, "spawn", spy_spawn)


def engines_exited(fleet: EngineFleet) -> bool:
    """Whether the fleet started engines and every one's process has exited."""
    return bool(fleet.handles) and all(h.proc.poll() is not None for h in fleet.handles)


@pytest.mark.parametrize("pool", ["ray", "driver"])
def test_a_failed_learner_build_stops_the_engines_and_workers_started_before_it(
    tiny_model, tmp_path, monkeypatch, pool
):
    seen: dict[str, object] = {}
    start = WorkerStart.__init__

    def spy_start(workers, *args, **kwargs):
        seen["workers"] = workers
        return start(workers, *args, **kwargs)

    def failing_build(*args, **kwargs):
        started = seen["workers"].pool()  # the workers' start is under way: let it finish
        seen["actors"] = list(getattr(started, "workers", []))  # Ray's
        seen["threads"] = [h.thread for h in getattr(started, "hosts", [])]  # the driver's
        raise RuntimeError("learner build failed")

    spy_on_the_fleet(monkeypatch, seen)
    monkeypatch.setattr(WorkerStart, "__init__", spy_start)
    monkeypatch.setattr(run_module, "build_learner", failing_build)
    with pytest.raises(RuntimeError, match="learner build failed"):
        run_module.run(shrunk(tiny_model, tmp_path, f"rollout.worker_pool={pool}"))
    assert engines_exited(seen["fleet"])  # engines stopped
    assert len(seen["actors"] if pool == "ray" else seen["threads"]) == 2
    assert not any(t.is_alive() for t in seen["threads"])  # the driver's workers ended
    if pool == "ray":
        import ray

        for actor in seen["actors"]:  # rollout workers killed
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.pid.remote(), timeout=30)


def test_driver_workers_are_threads_of_the_driver_and_ray_never_starts(
    tiny_model, tmp_path, monkeypatch
):
    """`rollout.worker_pool: driver`: the workers run in the driver (no Ray, no process per
    worker), and the run trains as with Ray actors."""
    from asyncrl import net
    from asyncrl.rollout.local_pool import LocalWorkerPool

    def no_ray(*args, **kwargs):
        raise AssertionError("the run started Ray")

    seen: dict[str, object] = {}
    pool = WorkerStart.pool

    def spy_pool(workers):
        seen["pool"] = pool(workers)
        seen["size"] = seen["pool"].size()
        return seen["pool"]

    monkeypatch.setattr(net, "_init_ray", no_ray)
    monkeypatch.setattr(WorkerStart, "pool", spy_pool)
    extra = ("max_steps=2", "logging.eval_interval=0", "rollout.worker_pool=driver")
    summary = run_module.run(shrunk(tiny_model, tmp_path, *extra))
    assert isinstance(seen["pool"], LocalWorkerPool) and seen["size"] == 2
    assert summary["steps"] >= 2


# A run started from Python (a bench, a notebook): no SIGTERM handler of its own.
FROM_PYTHON = (
    "import sys; from asyncrl.config import load_config; from asyncrl.run import run; "
    "run(load_config(None, sys.argv[1:]))"
)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.parametrize("how", ["cli", "python"])
def test_sigterm_ends_a_run_in_order(tiny_model, tmp_path, how):
    """By the CLI's handler, or, for a run started from Python, the one the run sets as Ray
    did when it started on the main thread (the default action would kill it on the spot)."""
    overrides = shrunk_overrides(
        tiny_model, tmp_path, "max_steps=100000", "logging.eval_interval=0"
    )
    command = ["-m", "asyncrl.cli", "run"] if how == "cli" else ["-c", FROM_PYTHON]
    proc = subprocess.Popen(
        [sys.executable, *command, *overrides],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    try:
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2,
                 "the run's first trained steps", 180)  # fmt: skip
        started = descendants(proc.pid) - {proc.pid}  # engine server, Ray's, rollout workers
        assert started
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for(lambda: not any(running(p) for p in started), "the run's processes to stop", 60)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert any(r.get("version") for r in rows)  # the trained steps' rows were kept
    assert (tmp_path / "summary.json").exists()  # the logger closed: the run unwound in order


def test_the_learner_closes_after_the_engines_stop(tiny_model, tmp_path, monkeypatch):
    """A weight sync still running as the run unwinds reads the learner (its weights, its
    process groups): the learner closes last, once every engine process has exited."""
    seen: dict[str, object] = {}
    build = run_module.build_learner

    def spy_build(*args, **kwargs):
        learner = build(*args, **kwargs)
        close = learner.close

        def close_last() -> None:
            seen["engines_exited"] = engines_exited(seen["fleet"])
            close()

        learner.close = close_last
        return learner

    spy_on_the_fleet(monkeypatch, seen)
    monkeypatch.setattr(run_module, "build_learner", spy_build)
    run_module.run(shrunk(tiny_model, tmp_path, "max_steps=2", "logging.eval_interval=0"))
    assert seen["engines_exited"] is True


def test_an_engine_that_fails_to_spawn_leaves_the_ones_before_it_stoppable(tiny_model, tmp_path):
    """`EngineFleet.spawn` keeps each engine as it starts: when engine 1 fails to start,
    engine 0 is in `handles`, so the run's exit stops it (it used to be lost with the list)."""
    from asyncrl.net import AsyncRunner

    class Handle:
        stopped = False

        def stop(self) -> None:
            self.stopped = True

    class Launcher:
        def __init__(self) -> None:
            self.first = Handle()

        def spawn(self, index: int) -> Handle:
            if index == 1:
                raise RuntimeError("engine 1 failed to start")
            return self.first

        def close(self) -> None:
            pass

    cfg = shrunk(tiny_model, tmp_path, "actor_infer.device_mapping=[0,1]")
    runner = AsyncRunner()
    try:
        fleet = EngineFleet(
            cfg.actor_infer, cfg.weight_sync, "abort", tiny_model, tmp_path, seed=0,
            request_timeout_s=5.0, runner=runner,
        )  # fmt: skip
        assert fleet.num_engines == 2
        fleet.launcher = launcher = Launcher()
        with pytest.raises(RuntimeError, match="engine 1 failed"):
            fleet.spawn()
        assert fleet.handles == [launcher.first]
        fleet.stop()
        assert launcher.first.stopped
    finally:
        runner.close()


def test_the_sigterm_handler_a_run_keeps():
    """The run's handler is taken before Ray starts: the one Python has (the CLI's), or, where
    none is set, one that unwinds (exit status 143) as Ray's did from the main thread."""
    import threading

    from asyncrl import net

    def mine(signum, frame):  # pragma: no cover - never delivered
        pass

    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        kept = net.sigterm_handler()
        assert kept is net.exit_on_signal
        with pytest.raises(SystemExit) as raised:
            kept(signal.SIGTERM, None)
        assert raised.value.code == 128 + signal.SIGTERM
        signal.signal(signal.SIGTERM, mine)
        assert net.sigterm_handler() is mine
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as Ray's start leaves it, say
        worker = threading.Thread(target=net.reclaim_sigterm, args=(mine,))
        worker.start()
        worker.join()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # only the main thread sets
        net.reclaim_sigterm(mine)
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_driver_threads_are_refused_where_workers_run_beside_engines_on_the_nodes():
    from asyncrl.config import ConfigError, load_config

    cluster = [
        "cluster.address=auto",
        "cluster.bind_host=0.0.0.0",
        "rollout.transport_host=0.0.0.0",
    ]
    with pytest.raises(ConfigError, match="rollout.worker_pool 'driver' with cluster.address"):
        load_config(None, [*cluster, "rollout.worker_pool=driver"])


# The CPU default's driver, from `import asyncrl.run` to a built learner and its first step, in a
# fresh process: what it must not import (each was seconds of the driver's start-up CPU).
DRIVER_IMPORTS = """
import sys
from pathlib import Path
import asyncrl.run as run_module
from asyncrl.config import load_config
late = ("transformers.modeling_utils", "matplotlib", "torch.nn.attention.varlen", "ray")
print("import", *[m for m in late if m in sys.modules])
cfg = load_config(None, ["rollout.worker_pool=process"])
learner = run_module.build_learner(cfg, Path(sys.argv[1]))
print("build", type(learner.model).__name__, *[m for m in late if m in sys.modules])
"""


def test_the_cpu_default_driver_builds_its_learner_without_transformers_modeling(tiny_model):
    """`import asyncrl.run` imports neither transformers' modeling code, matplotlib (the plots
    at exit), torch's varlen kernel nor Ray; the CPU default's learner reads its policy without
    transformers' modeling code (`learner/torch/lean_policy.py`: its modeling, masking and loss
    modules pull in torch._inductor, scipy and accelerate)."""
    out = subprocess.run(
        [sys.executable, "-c", DRIVER_IMPORTS, str(tiny_model)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert out.stdout.splitlines()[-2:] == ["import", "build LeanCausalLM"], out.stdout

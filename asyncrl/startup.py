"""Every thread and process of a run's rollout side, in start order, and their sub-configs.

Order, for the CPU default (2 cores): the engines' processes start first (`launch_engines`: an
hf engine imports torch and reads the embedded model's weights straight into the lean decoder,
`engine/hf/lean_model.py`, beside the driver's learner build), then the ZMQ receiver and the
rollout workers (`WorkerStart`, in a thread of its own while the learner is built: Ray and the
worker actors, or with `rollout.worker_pool: driver` threads of the driver,
`rollout/local_pool.py`, or with `process` child processes, `rollout/process_pool.py`), then, once the learner exists,
`start_rollout` waits for both, pushes the learner's weights to the engines and starts the
dispatcher and the pump. Every start registers its stop on the run's ExitStack, so a failure
at any point stops what already runs, in reverse order.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config, derive_plan
from asyncrl.config.async_checks import pause_mode, staleness_ceiling
from asyncrl.data.prompts import PromptSource
from asyncrl.data.tokenizer import plain_decoder_json, tokenizer_class_name
from asyncrl.learner.base import Learner
from asyncrl.net import ray_env, reclaim_sigterm, sigterm_handler
from asyncrl.orchestrator import Orchestrator
from asyncrl.replay.queue import ReplayQueue
from asyncrl.rollout.evaluation import Evaluator
from asyncrl.rollout.settings import RolloutSettings
from asyncrl.threads import ThreadBudget
from asyncrl.weights.lora_native import native_lora

if TYPE_CHECKING:  # imported where they start: the engine layer and Ray load only for a run
    from asyncrl.engine.fleet import EngineFleet
    from asyncrl.net import AsyncRunner
    from asyncrl.rollout.local_pool import LocalWorkerPool
    from asyncrl.rollout.process_pool import ProcessWorkerPool
    from asyncrl.rollout.ray_pool import RayWorkerPool

    RolloutPool = RayWorkerPool | LocalWorkerPool | ProcessWorkerPool


#: At exit, how long to wait for a rollout workers' start still under way (Ray and the actors
#: coming up: ~5-10 s on a loaded 2-core box) before leaving them to Ray's shutdown.
START_WAIT_S = 60.0


def launch_engines(
    stack: ExitStack, cfg: Config, model_dir: Path, budget: ThreadBudget | None
) -> EngineFleet:
    """The run's engines, their processes started where the launcher can start them without
    waiting (hf_infer: `EngineFleet.spawn`), so their models load while the driver builds its
    learner (on the CPU default, the engine's ~6 s start beside the learner's ~3 s); the
    control plane's event loop with them. `stack` stops both, the loop last."""
    import secrets

    from asyncrl.net import AsyncRunner

    runner = AsyncRunner()  # thread: the control plane's event loop (health, sync, eval)
    stop_later(stack, runner.close)
    # The engines' key, the run's secret for their HTTP endpoints (never printed).
    fleet = make_fleet(cfg, model_dir, runner, secrets.token_hex(32))
    stop_later(stack, fleet.stop)
    fleet.spawn(budget.engines if budget is not None else ())
    return fleet


class WorkerStart:
    """The ZMQ receiver (at once) and the rollout workers (Ray actors, or the driver's threads
    or child processes: `rollout.worker_pool`). With the engines'
    URLs known (`EngineFleet.spawn` started them), Ray and the workers start at once in a
    thread of their own, so they boot while the driver builds its learner; `pool` waits for
    them. Otherwise (a launcher whose `launch` waits for each engine) `pool` starts them, from
    `EngineFleet.start` once the URLs are known. Ray itself starts on a thread that lives as
    long as the process either way (`net.init_ray`)."""

    def __init__(
        self, stack: ExitStack, cfg: Config, model_dir: Path, fleet: EngineFleet, tokenizer: Any
    ) -> None:
        import secrets

        from asyncrl.transport.zmq import Receiver, ReceiverConfig

        self.cfg, self.model_dir, self.fleet = cfg, model_dir, fleet
        self.address = cfg.cluster.address.strip() or None  # multi-node: each beside its engine
        ro = cfg.rollout
        # The stream's secret, apart from the engines' key (which may show on an engine's
        # command line: SGLang's --api-key) so that its reader cannot sign groups. Passed as
        # an argument (Ray does not log actor arguments), never printed.
        self.secret = secrets.token_bytes(32)
        # Only connections that prove the secret are read: PLAIN on loopback, CURVE elsewhere.
        self.receiver = Receiver(
            ReceiverConfig(host=ro.transport_host, port=ro.transport_port, secret=self.secret)
        )
        stop_later(stack, self.receiver.close)  # PULL socket, read by the pump; asyncrl-zap
        self.tokenizer_class = tokenizer_class_name(tokenizer)  # the workers skip AutoTokenizer
        # and, where it decodes alike, transformers: the `tokenizers` library decodes
        self.tokenizer_json = plain_decoder_json(tokenizer)
        self._started: cf.Future[RolloutPool] | None = None
        self._pool: RolloutPool | None = None
        self._sigterm = sigterm_handler()  # the run's, given back once Ray has taken it
        stop_later(stack, self._close)
        self.uses_ray = uses_ray(cfg)
        if fleet.handles:  # spawned: their URLs are known now
            if self.uses_ray:
                ray_env(self.address)  # here: the main thread reads the environment too
            self._started = cf.Future()
            # A daemon: a start stuck in Ray (an actor never placed) must not hold up the exit.
            threading.Thread(target=self._start_into, name="asyncrl-workers", daemon=True).start()

    def settings(self, index: int) -> RolloutSettings:
        """Rollout worker `index`'s sub-config (the evaluator's too: index 0)."""
        from asyncrl.net import advertised_host

        fleet, host = self.fleet, self.cfg.rollout.transport_host
        urls = fleet.urls_for_worker(index)  # fleet.api_key: ours, or the engines' own
        made = rollout_settings(self.cfg, self.model_dir, urls, self.receiver.port, self.secret,
                                fleet.api_key, self.tokenizer_class, fleet.routed(),
                                self.tokenizer_json)  # fmt: skip
        if fleet.multinode:  # workers on other nodes reach the receiver at this node's address
            made = dataclasses.replace(made, transport_host=advertised_host(host))
        return made

    def _start(self) -> RolloutPool:  # Ray actors, threads of this one, or its children
        n, where = self.cfg.rollout.num_actors, self.cfg.rollout.worker_pool
        if where == "process":
            from asyncrl.rollout.process_pool import ProcessWorkerPool

            return ProcessWorkerPool(self.settings, n)
        if where == "driver":
            from asyncrl.rollout.local_pool import LocalWorkerPool

            return LocalWorkerPool(self.settings, n)
        from asyncrl.rollout.ray_pool import RayWorkerPool

        return RayWorkerPool(self.settings, n, self.fleet.worker_options, self.address)

    def _start_into(self) -> None:
        started = self._started
        try:
            started.set_result(self._start())
        except BaseException as e:  # handed to `pool`'s caller
            started.set_exception(e)

    def pool(self) -> RolloutPool:
        """The workers, their start waited for (or run here); raises what it raised. From the
        main thread."""
        if self._pool is None:
            self._pool = self._started.result() if self._started is not None else self._start()
        reclaim_sigterm(self._sigterm)  # Ray took SIGTERM over when it started
        return self._pool

    def _close(self) -> None:
        """At exit: the workers, once their start is done (a start that failed stopped its
        workers itself, and raised to `pool`'s caller); one still starting after
        `START_WAIT_S` is left to Ray's shutdown."""
        if self._started is not None and self._pool is None:
            try:
                if self._started.exception(timeout=START_WAIT_S) is None:
                    self._pool = self._started.result()
            except cf.TimeoutError:
                print(f"asyncrl: the rollout workers' start outlasted {START_WAIT_S:.0f} s at exit")
        if self._pool is not None:
            self._pool.close()


def start_rollout(
    stack: ExitStack,
    cfg: Config,
    queue: ReplayQueue,
    prompts: PromptSource,
    learner: Learner,
    fleet: EngineFleet,
    workers: WorkerStart,
) -> tuple[Orchestrator, Evaluator]:
    """The rest of the rollout side, once the learner exists: the engines (those not started
    yet start now) and the workers, waited for, the learner's weights pushed to the engines,
    then the dispatcher and the pump; `stack` stops them in reverse (a stop that fails is
    reported and the others still run)."""
    from asyncrl.orchestrator import GroupLimits, GroupPump, model_vocab_size
    from asyncrl.rollout.dispatch import Dispatcher

    ro = cfg.rollout
    # processes: the engine servers (+ router) not launched yet; the spawned ones load on
    # while the rollout workers start (they need the engines' URLs, not the engines); then the
    # learner's weights on each.
    pool = fleet.start(learner, meanwhile=workers.pool)
    dispatcher = Dispatcher(
        pool, queue, prompts.next_item, ro.max_inflight_prompts, lambda: fleet.synced_version
    )
    stop_later(stack, dispatcher.start().stop)  # thread: prompts → rollout workers
    limits = GroupLimits(model_vocab_size(workers.model_dir), lambda: learner.version)
    pump = GroupPump(workers.receiver, queue, limits)
    stop_later(stack, pump.__enter__().__exit__)  # thread: receiver → replay queue
    stop_later(stack, queue.close)  # first to run at exit: wakes a blocked take
    items = heldout_items(cfg, prompts)
    evaluator = Evaluator(cfg.logging, cfg.max_steps, items, workers.settings(0), fleet)
    overlap = overlap_sync(cfg)
    return Orchestrator(ro, fleet, dispatcher, pump, queue, learner, overlap), evaluator


def uses_ray(cfg: Config) -> bool:
    """Whether the rollout workers are Ray actors (`rollout.worker_pool`), else threads or
    child processes of the driver (no Ray on one host: the engines are its subprocesses and a
    one-process learner needs none)."""
    return cfg.rollout.worker_pool == "ray"


def make_fleet(cfg: Config, model_dir: Path, runner: AsyncRunner, api_key: str) -> EngineFleet:
    """The run's engines (not started): `api_key` is the run's engine secret, `runner` the
    control plane's event loop."""
    from asyncrl.engine.fleet import EngineFleet

    return EngineFleet(
        cfg.actor_infer, cfg.weight_sync, pause_mode(cfg), model_dir, Path(cfg.output_dir),
        seed=cfg.seed, request_timeout_s=cfg.rollout.request_timeout_s, runner=runner,
        api_key=api_key,
        eval_priority=cfg.logging.eval_priority if cfg.logging.eval_interval > 0 else None,
        dedicated_eval=cfg.logging.eval_engine == "dedicated",  # rollout never routed to it
        cluster=cfg.cluster,  # multi-node: engines are Ray actors placed on the nodes
        lora=native_lora(cfg.weight_sync, cfg.actor_train.model_args, cfg.output_dir),
    )  # fmt: skip


def rollout_settings(
    cfg: Config,
    model_dir: Path,
    engine_urls: list[str],
    transport_port: int = 0,
    transport_secret: bytes | None = None,
    engine_api_key: str | None = None,
    tokenizer_class: str = "",
    engine_router: bool = False,
    tokenizer_json: str = "",
) -> RolloutSettings:
    """A rollout worker's own sub-config: the run config's sections, passed whole, the run's
    secrets (the transport's secret, the engines' API key; None: none), the tokenizer's
    class as the driver resolved it ('': the worker resolves it), whether `engine_urls` is
    a router, and the serialized `tokenizers` backend that decodes alike ('': none,
    `plain_decoder_json`)."""
    host = cfg.rollout.transport_host
    return RolloutSettings(
        engine_urls=engine_urls,
        transport_host="127.0.0.1" if host in ("0.0.0.0", "*") else host,
        transport_port=transport_port,
        tokenizer_path=str(model_dir),
        tokenizer_class=tokenizer_class,
        tokenizer_json=tokenizer_json,
        generating=cfg.actor_infer.generating_args,
        rollout=cfg.rollout,
        algorithm=cfg.algorithm,
        env=cfg.env,
        n=cfg.num_return_sequences_in_group,
        response_length=cfg.response_length,
        seed=cfg.seed,
        transport_secret=transport_secret,
        engine_api_key=engine_api_key,
        engine_router=engine_router,
        routed_experts=cfg.actor.router_replay == "r3",
        engine_lora=native_lora(cfg.weight_sync, cfg.actor_train.model_args, cfg.output_dir)
        is not None,
    )


def heldout_items(cfg: Config, prompts: PromptSource) -> list[Any]:
    """What evaluation plays: held-out prompts, or held-out env seeds (disjoint from the
    training ones; played as episodes) in an env run."""
    if cfg.env is None:
        return prompts.heldout_items(cfg.logging.eval_size)
    from asyncrl.rollout.evaluation import heldout_seed_items

    return heldout_seed_items(cfg.env, cfg.logging.eval_size)


def overlap_sync(cfg: Config) -> bool:
    """`weight_sync.overlap` for this run: auto overlaps for a one-process torch learner on
    the CPU (the weights' copy is host memory) at `max_staleness` >= 2 (auto: its ceiling,
    max_staleness_hard), unless `stale_policy: wait`. At max_staleness 1 a version's prompts can start only once its sync lands, so an
    overlapped sync leaves the engines less time for the next batch (measured on the CPU
    default: 51-54 ms a step against 47-49 waiting for every sync; at 2: 49 against 58)."""
    from asyncrl.device import detect_device, worker_device

    mode, train = cfg.weight_sync.overlap, cfg.actor_train
    if mode != "auto":
        return mode == "always"
    where = worker_device(list(train.device_mapping), detect_device().kind)
    torch_learner = train.strategy_args.strategy_name == "fsdp2_train"
    one = derive_plan(cfg).world_size == 1 and torch_learner and where == "cpu"
    return one and staleness_ceiling(cfg) >= 2 and cfg.async_.stale_policy != "wait"


def stop_later(stack: ExitStack, stop: Callable[[], object]) -> None:
    """Register `stop` on `stack`: best effort, a failure is reported and the others run."""

    def best_effort(*_: object) -> None:
        try:
            stop()
        except Exception as e:  # noqa: BLE001 - shutdown is best effort, report and go on
            print(f"asyncrl: shutdown: {type(e).__name__}: {e}")

    stack.callback(best_effort)

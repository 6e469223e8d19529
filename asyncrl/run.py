"""The training loop, top to bottom. Synchronous training is `async.max_staleness: 0` of it.

Rollout workers generate continuously (the dispatcher feeds them prompts within the replay
queue's admission capacity) and push groups over ZMQ into the queue; this loop takes a batch
no staler than the bound, updates the policy, broadcasts the weights and opens capacity for the
next version. With max_staleness 0 the capacity rule admits exactly one batch per version, and
generation for version v+1 starts only after the weights of v+1 reach the engines.
`startup.py` starts every thread and process of the rollout side, in order.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

from asyncrl.checkpoint import Checkpointer, Loaded, load_contents
from asyncrl.config import Config, derive_plan, to_dict
from asyncrl.config.async_checks import max_response_tokens
from asyncrl.config.plan import check_resumed_plan, schedule_record
from asyncrl.data.prompts import PromptSource
from asyncrl.learner.base import Learner, make_learner
from asyncrl.learner.placement import RankPlacement
from asyncrl.learner.profiler import profile_step
from asyncrl.metrics import MetricsLogger
from asyncrl.metrics.batch import BatchMetrics, TrainedGroupLog
from asyncrl.metrics.collapse import CollapseWatch
from asyncrl.metrics.deferred import DeferredRows
from asyncrl.metrics.rundir import claim_output_dir, roll_back
from asyncrl.orchestrator import resolve_model
from asyncrl.preflight import check_machine
from asyncrl.replay.filters import dapo_zero_variance
from asyncrl.replay.queue import ReplayConfig, ReplayQueue
from asyncrl.replay.staleness_control import ControlSettings
from asyncrl.replay.tokens import TokenBudget
from asyncrl.rollout.evaluation import Evaluator
from asyncrl.startup import WorkerStart, launch_engines, start_rollout
from asyncrl.threads import DriverThreads, ThreadBudget, ThreadShare


def run(cfg: Config, overwrite: bool = False) -> dict[str, Any]:
    """Train as `cfg` says. output_dir belongs to one run: a fresh run into one that holds a
    run is refused unless `overwrite`, which first moves that run's files into
    `output_dir/.overwritten-<time>/`; `actor.checkpoint.resume` continues it instead. The
    driver (learner rank 0) runs inside its share of the thread budget, restored after."""
    started = time.perf_counter()  # `time/first_batch_s` counts from here
    check_machine(cfg)  # a backend this machine cannot run: one line, before anything starts
    budget = thread_budget(cfg)
    with DriverThreads(budget.learner[0]) as driver:
        return train(cfg, overwrite, budget, driver, started)


def train(
    cfg: Config, overwrite: bool, budget: ThreadBudget, driver: DriverThreads, started: float
) -> dict[str, Any]:
    """`run`'s body: set up, start every process and thread, and loop."""
    out = Path(cfg.output_dir)
    ckpt = Checkpointer(out, cfg.actor.checkpoint.save_contents, cfg.actor.checkpoint.async_save)
    found = claim_output_dir(out, ckpt, cfg.actor.checkpoint, overwrite)  # before any start
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(cfg.actor_train.model_args)
    # Exits in reverse: the rollout side, the logger (summary), the workers, the engines, then
    # the learner: a weight sync still running as the run unwinds (the control loop's) reads
    # its weights and, with several ranks, its process groups, which its close destroys.
    with ExitStack() as stack:
        last = stack.enter_context(ExitStack())  # the learner's, built after the engines start
        placement = reserve_learner(stack, cfg)  # multi-node accelerator ranks: before engines
        engines = launch_engines(stack, cfg, model_dir, budget)  # they load as the learner does
        prompts = PromptSource(cfg, model_dir)
        workers = WorkerStart(stack, cfg, model_dir, engines, prompts.tokenizer)  # likewise
        learner = last.enter_context(closing(build_learner(cfg, model_dir, placement)))
        queue = make_queue(cfg)
        step = resume(found, ckpt, cfg, learner, queue, prompts)
        logger = stack.enter_context(MetricsLogger(
            out, cfg.logging, to_dict(cfg), max_steps=cfg.max_steps, append=found is not None
        ))  # fmt: skip
        audit, batch_metrics, watch = TrainedGroupLog(out), BatchMetrics(), CollapseWatch()
        rows = DeferredRows(logger)  # a step's row waits for its evaluation (off the loop)
        rollout, evaluator = start_rollout(stack, cfg, queue, prompts, learner, engines, workers)
        pin_learner(driver, learner, budget)  # now: what started before is not pinned with it
        begun = step  # this process's first step (a resumed run's too) reports the start-up
        stack.callback(rows.flush, ())  # on the way out, a row still held goes without eval
        if found is None:  # a resumed step's evaluation is in its row already
            evaluator.submit(step, learner.version, learner)
            rows.add(step, {})
        while step < cfg.max_steps:
            waited = time.perf_counter()
            groups = rollout.take_batch(cfg.rollout_batch_size, learner.version)
            idle = time.perf_counter() - waited
            with profile_step(cfg.actor.profiler, out, step + 1):  # actor.profiler's steps
                metrics = learner.step(groups)  # evaluations in flight run on meanwhile
            step += 1
            metrics.update(startup_metrics(started, budget) if step == begun + 1 else {})
            audit.append(step, groups)
            evaluating = evaluator.due(step)  # this step's weights are to be evaluated
            if sync_due(cfg, learner.version, step) or evaluating:
                blocked = evaluator.wait_before_sync(evaluating)  # pinned to their engines' version
                idle += blocked
                overlap = not evaluating and step < cfg.max_steps  # the next step trains meanwhile
                metrics.update(rollout.sync_weights(overlap, evaluating))  # (weight_sync.overlap)
                metrics["learner/eval_wait_seconds"] = blocked
            metrics.update(rollout.steer_staleness(step, metrics))  # max_staleness: auto
            rollout.open_admission(learner.version)  # overlapped: once the engines hold it
            metrics.update(batch_metrics(groups, learner.version, idle))
            metrics.update(rollout.metrics() | evaluator.metrics())
            if warning := watch.update(metrics):  # entropy, lengths or advantages collapsed
                print(f"asyncrl: step {step}: {warning}")
            evaluator.submit(step, learner.version, learner)  # the weights this step produced
            rows.add(step, metrics)
            land(rows, evaluator)
            if ckpt_due(cfg, step):  # every row up to it is written first: a resume keeps them
                land(rows, evaluator, drain=True)
                logger.flush()  # written by the sinks' threads: on disk before the checkpoint
                state = {"prompts": prompts.state_dict(), **rollout.state_dict(),
                         "plan": schedule_record(derive_plan(cfg))}  # fmt: skip
                ckpt.save(step, learner, {**state, "version": learner.version}, prompts.tokenizer)
        land(rows, evaluator, drain=True)  # the last evaluation lands before the summary
        ckpt.wait()  # an async save finishes (or raises) before the learner closes
    return logger.close()


def make_queue(cfg: Config) -> ReplayQueue:
    """The replay queue of the run: staleness bound (fixed, or adaptive: `auto`), stale
    policy, token budget, filters."""
    filters = (dapo_zero_variance,) if cfg.algorithm.filter_zero_variance_groups else ()
    a = cfg.async_
    control = None
    if a.max_staleness == "auto":  # the controller's own defaults, as the docstring says
        control = ControlSettings(
            a.max_staleness_hard, a.target_ess, a.target_kl, signal=a.staleness_signal
        )
    tokens = None
    if a.max_inflight_tokens:
        tokens = TokenBudget(
            a.max_inflight_tokens, cfg.num_return_sequences_in_group, cfg.prompt_length,
            max_response_tokens(cfg),
        )  # fmt: skip
    start = a.max_staleness if control is None else min(control.start, control.hard)
    return ReplayQueue(
        ReplayConfig(
            start, cfg.rollout_batch_size, filters=filters, stale_policy=a.stale_policy,
            max_staleness_hard=a.max_staleness_hard, tokens=tokens, control=control,
        )
    )  # fmt: skip


def sync_due(cfg: Config, version: int, step: int) -> bool:
    """The configured sync cadence (the loop syncs at evaluation steps too: an evaluation
    measures the step's own weights, which must be on the engines)."""
    return version % cfg.async_.sync_interval == 0 or step == cfg.max_steps


def land(rows: DeferredRows, evaluator: Evaluator, drain: bool = False) -> None:
    """Finished evaluations (all of them, waiting, when `drain`) into their steps' rows; the
    rows no evaluation holds any more, written."""
    rows.land(evaluator.drain() if drain else evaluator.results())
    rows.flush(evaluator.in_flight_steps())


def build_learner(cfg: Config, model_dir: Path, placement: RankPlacement | None = None) -> Learner:
    """The run's learner (`actor_train.strategy_args.strategy_name`), before any resume;
    `placement`: where its ranks run (default: `rank_placement(cfg)`)."""
    plan = derive_plan(cfg)  # the schedules' lengths: the optimizer steps the learner takes
    critic = {}
    if cfg.critic is not None:  # it trains every rollout, the warm-up ones too
        critic = {"critic_total_steps": cfg.max_steps * plan.critic_optimizer_steps_per_rollout}
    return make_learner(
        cfg.actor_train.strategy_args.strategy_name, world_size=plan.world_size,
        model_path=model_dir, train=cfg.actor_train, actor=cfg.actor, algorithm=cfg.algorithm,
        temperature=cfg.actor_infer.generating_args.temperature,
        total_steps=plan.actor_optimizer_steps, seed=cfg.seed,
        reference=cfg.reference, critic=cfg.critic,
        placement=placement or rank_placement(cfg), **critic,
    )  # fmt: skip


def ckpt_due(cfg: Config, step: int) -> bool:
    interval = cfg.actor.checkpoint.save_interval
    return step == cfg.max_steps or (interval > 0 and step % interval == 0)


def resume(
    found: Loaded | None,
    ckpt: Checkpointer,
    cfg: Config,
    learner: Learner,
    queue: ReplayQueue,
    prompts: PromptSource,
) -> int:
    """Restore learner, data position, queue contents and the in-flight ledger (its prompts
    are re-issued first) from `found`, and roll the run back to its step (logs, later
    checkpoints). Returns the step to continue from: the checkpoint's, or 0 for a fresh run."""
    if found is None:
        return 0
    # the learner's schedules continue from their positions: they must fit this config's plan
    check_resumed_plan((found.extra or {}).get("plan"), cfg)
    extra = found.apply(learner, load_contents(cfg.actor.checkpoint))
    if extra:
        prompts.load_state_dict(extra["prompts"])
        # the ledger is stored once, as `outstanding`; loaded now so admission counts it
        queue.load_state_dict({**extra["queue"], "outstanding": extra.get("outstanding", [])})
    queue.set_version(learner.version)
    roll_back(Path(cfg.output_dir), ckpt, found)
    print(f"asyncrl: resumed from {found.path} at step {found.step}, version {learner.version}")
    if not extra:
        print(
            "asyncrl: resumed the learner only (load_contents has no extra): the data "
            "position, replay queue and RNG start afresh"
        )
    return found.step


def thread_budget(cfg: Config) -> ThreadBudget:
    """The run's CPU thread budget (`threads`) over the learner's ranks and the hf engines this
    host starts, printed once."""
    from asyncrl.device import detect_device, worker_device
    from asyncrl.threads import plan_threads, usable_cores

    infer, train_cfg, t = cfg.actor_infer, cfg.actor_train, cfg.threads
    multinode = bool(cfg.cluster.address.strip())
    local_hf = infer.strategy_args.strategy_name == "hf_infer" and not multinode
    # As HFLauncher counts them; SGLang engines and engines on other nodes are not budgeted.
    engines = max(1, len(infer.device_mapping) // infer.num_gpus_per_worker) if local_hf else 0
    torch_learner = train_cfg.strategy_args.strategy_name == "fsdp2_train"
    where = worker_device(list(train_cfg.device_mapping), detect_device().kind)
    ranks = derive_plan(cfg).world_size
    local_ranks = 1 if multinode else ranks  # multi-node: the other ranks may be elsewhere
    budget = plan_threads(
        usable_cores(), local_ranks, engines, t.learner, t.engine, t.pin,
        learner_on_cpu=torch_learner and where == "cpu",
    )  # fmt: skip
    others = (ThreadShare(),) * (ranks - local_ranks)  # not budgeted: torch's default
    budget = dataclasses.replace(budget, learner=budget.learner + others)
    print(f"asyncrl: threads: {budget.describe()}")
    return budget


def pin_learner(driver: DriverThreads, learner: Learner, budget: ThreadBudget) -> None:
    """Pin the learner to its cores once every other process has started (a child inherits
    its creator's pinning): the driver (rank 0) and, with several, the other ranks."""
    driver.pin()
    set_rank_threads = getattr(learner, "set_rank_threads", None)  # DistributedTorchLearner
    if set_rank_threads is not None:
        set_rank_threads(budget.learner)


def startup_metrics(started: float, budget: ThreadBudget) -> dict[str, float]:
    """The first trained step's start-up figures: seconds from `run()` to this batch trained,
    and the thread budget the run got."""
    engine = budget.engines[0] if budget.engines else ThreadShare()
    pinned = any(s.cpus for s in (*budget.learner, *budget.engines))
    return {
        "time/first_batch_s": time.perf_counter() - started,
        "threads/learner": float(budget.learner[0].threads),
        "threads/engine": float(engine.threads),
        "threads/pinned": float(pinned),
    }


def reserve_learner(stack: ExitStack, cfg: Config) -> RankPlacement:
    """The learner's placement. Multi-node on accelerators, its ranks are planned and their
    devices held now, before the engines are placed (a driver's node without a free device is
    refused here, before anything starts); the learner takes them over, else the stack frees
    them."""
    placement = rank_placement(cfg)
    if placement.multinode:
        from asyncrl.config.rank_plan import node_group_size
        from asyncrl.device import detect_device

        sa = cfg.actor_train.strategy_args
        stack.callback(placement.release_reserved)
        placement.reserve(detect_device().kind, derive_plan(cfg).world_size,
                          node_group_size(sa.strategy_name, sa.strategy_config))  # fmt: skip
    return placement


def rank_placement(cfg: Config) -> RankPlacement:
    """Where a multi-rank learner's other ranks run. Multi-node, the run joins its cluster
    first (before the learner's ranks or the engines start: one Ray per process)."""
    if cfg.cluster.address.strip():
        from asyncrl.net import init_ray

        init_ray(cfg.cluster.address.strip())
    return RankPlacement.from_config(cfg)

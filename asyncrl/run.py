"""The training loop, top to bottom. Synchronous training is `async.max_staleness: 0` of it.

Rollout actors generate continuously (the dispatcher feeds them prompts within the replay
queue's admission capacity) and push groups over ZMQ into the queue; this loop takes a batch
no staler than the bound, updates the policy, broadcasts the weights and opens capacity for the
next version. With max_staleness 0 the capacity rule admits exactly one batch per version, and
generation for version v+1 starts only after the weights of v+1 reach the engines.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from asyncrl.config import Config, derive_plan, to_dict


def run(cfg: Config) -> dict[str, Any]:
    from asyncrl.checkpoint import Checkpointer
    from asyncrl.learner.base import make_learner
    from asyncrl.metrics import MetricsLogger
    from asyncrl.replay.filters import dapo_zero_variance
    from asyncrl.replay.queue import ReplayConfig, ReplayQueue
    from asyncrl.rollout.cluster import RolloutCluster, resolve_model
    from asyncrl.rollout.prompts import PromptSource

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(cfg.actor_train.model_args)
    plan = derive_plan(cfg)
    prompts = PromptSource(cfg, model_dir)
    gen = cfg.actor_infer.generating_args
    learner = make_learner(
        cfg.actor_train.strategy_args.strategy_name, world_size=plan.world_size,
        model_path=model_dir, train=cfg.actor_train, actor=cfg.actor, algorithm=cfg.algorithm,
        temperature=gen.temperature, total_steps=cfg.max_steps * plan.optimizer_steps_per_rollout,
        seed=cfg.seed,
    )  # fmt: skip
    filters = (dapo_zero_variance,) if cfg.algorithm.filter_zero_variance_groups else ()
    queue = ReplayQueue(
        ReplayConfig(cfg.async_.max_staleness, cfg.rollout_batch_size, filters=filters)
    )
    ckpt = Checkpointer(out, cfg.actor.checkpoint.save_contents)
    resumed = resume(ckpt, cfg, learner, queue, prompts)
    logger = MetricsLogger(
        out, cfg.logging, to_dict(cfg), max_steps=cfg.max_steps, append=bool(resumed)
    )
    with logger, RolloutCluster(cfg, model_dir, queue, prompts, learner) as cluster:
        cluster.restore(resumed.get("outstanding", []))
        step = resumed.get("step", 0)
        logger.log(step, cluster.evaluate(step, learner.version))
        while step < cfg.max_steps:
            waited = time.perf_counter()
            groups = cluster.take_batch(cfg.rollout_batch_size, learner.version)
            idle = time.perf_counter() - waited
            metrics = learner.step(groups)
            step += 1
            cluster.record_trained(step, groups)
            if learner.version % cfg.async_.sync_interval == 0 or step == cfg.max_steps:
                metrics.update(cluster.sync_weights(learner))
            queue.set_version(learner.version)  # opens admission for the next version
            metrics.update(cluster.batch_metrics(groups, learner.version, idle, waited))
            metrics.update(cluster.evaluate(step, learner.version))
            logger.log(step, metrics)
            if ckpt_due(cfg, step):
                ckpt.save(step, learner, cluster.extra_state(prompts, step), prompts.tokenizer)
    if hasattr(learner, "close"):
        learner.close()
    return logger.close()


def ckpt_due(cfg: Config, step: int) -> bool:
    interval = cfg.actor.checkpoint.save_interval
    return step == cfg.max_steps or (interval > 0 and step % interval == 0)


def resume(ckpt: Any, cfg: Config, learner: Any, queue: Any, prompts: Any) -> dict[str, Any]:
    """Restore learner, data position, queue contents and prompts in flight (re-issued)."""
    path = ckpt.find(cfg.actor.checkpoint.resume)
    if path is None:
        return {}
    contents = set(cfg.actor.checkpoint.load_contents or cfg.actor.checkpoint.save_contents)
    extra = ckpt.load(path, learner, contents)
    if extra:
        prompts.load_state_dict(extra["prompts"])
        queue.load_state_dict(extra["queue"])
    queue.set_version(learner.version)
    print(
        f"asyncrl: resumed from {path} at step {extra.get('step', '?')}, version {learner.version}"
    )
    return extra

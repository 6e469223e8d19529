"""Checks of the loop's asynchrony: what happens to stale groups (`async.stale_policy`), how
engines take new weights mid-generation (`async.pause_mode`) and overlapped syncs
(`weight_sync.overlap`). Each failure is one ConfigError line naming the key."""

from __future__ import annotations

from asyncrl.config.rules import positive
from asyncrl.config.schema import Config, ConfigError


def check_async(cfg: Config) -> None:
    """Every check of this module, in order."""
    check_stale_policy(cfg)
    check_pause_mode(cfg)
    check_overlap(cfg)


def check_pause_mode(cfg: Config) -> None:
    """`pause_mode: none` keeps the engines generating during a sync; only an engine that holds
    every bucket until the last and loads them at once (hf_infer, `engine/hf/weights.py`) never
    steps on half-updated weights. SGLang loads each bucket as it arrives."""
    infer = cfg.actor_infer.strategy_args.strategy_name
    if cfg.async_.pause_mode == "none" and infer != "hf_infer":
        raise ConfigError(
            f"async.pause_mode: none needs hf_infer engines; {infer} loads each bucket as it "
            "arrives, so its running requests would step on half-updated weights: use in_place"
        )


def pause_mode(cfg: Config) -> str:
    """`async.pause_mode` for this run, `auto` resolved: none on hf_infer (its engines load a
    sync's buckets together between two steps), in_place on SGLang (it loads bucket by bucket)."""
    if cfg.async_.pause_mode != "auto":
        return cfg.async_.pause_mode
    return "none" if cfg.actor_infer.strategy_args.strategy_name == "hf_infer" else "in_place"


def check_overlap(cfg: Config) -> None:
    """`weight_sync.overlap: always` opens admission for a version only once its sync lands, while
    the learner already trains on: `stale_policy: wait` would gate on the older version."""
    if cfg.weight_sync.overlap == "always" and cfg.async_.stale_policy == "wait":
        raise ConfigError(
            "weight_sync.overlap: always with async.stale_policy: wait: the wait gate reads the "
            "version admission opened, which an overlapped sync opens late; use never or auto"
        )


def check_stale_policy(cfg: Config) -> None:
    """`stale_policy: correct` trains groups past max_staleness, sound only when the learner's
    rollout IS reweights them by pi_prox / pi_behaviour (`learner/objective.py:correct`) per
    sequence (or geometric mean), vetoing catastrophic ratios: a token-level weight leaves the
    product of a long stale response's ratios uncorrected."""
    a, alg = cfg.async_, cfg.algorithm
    positive("async.max_staleness_hard", a.max_staleness_hard, allow_zero=True)
    if a.stale_policy != "correct":
        return
    if a.max_staleness_hard < a.max_staleness:
        raise ConfigError(
            f"async.max_staleness_hard ({a.max_staleness_hard}) must be >= async.max_staleness "
            f"({a.max_staleness}) with stale_policy correct"
        )
    problems = [
        what
        for bad, what in (
            (alg.correction_mode == "bypass", "algorithm.correction_mode must not be bypass"),
            (alg.rollout_is_threshold is None, "algorithm.rollout_is_threshold must be set"),
            (not alg.rollout_is, "algorithm.rollout_is must be true"),
            (alg.rollout_is_level == "token", "algorithm.rollout_is_level: sequence|geometric"),
            (alg.rollout_is_veto_threshold is None, "algorithm.rollout_is_veto_threshold: set"),
        )
        if bad
    ]
    if problems:
        raise ConfigError(
            "async.stale_policy correct trains groups past max_staleness with rollout IS, "
            f"which this config does not apply: {'; '.join(problems)}"
        )

"""Checks of the loop's asynchrony: what happens to stale groups (`async.stale_policy`), the
adaptive bound (`async.max_staleness: auto`), the token budget (`async.max_inflight_tokens`),
how engines take new weights mid-generation (`async.pause_mode`) and overlapped syncs
(`weight_sync.overlap`). Each failure is one ConfigError line naming the key."""

from __future__ import annotations

from asyncrl.config.rules import positive
from asyncrl.config.schema import Config, ConfigError


def check_async(cfg: Config) -> None:
    """Every check of this module, in order."""
    check_stale_policy(cfg)
    check_auto_staleness(cfg)
    check_token_budget(cfg)
    check_pause_mode(cfg)
    check_overlap(cfg)


def staleness_ceiling(cfg: Config) -> int:
    """The highest staleness bound the run may have: max_staleness, or with auto the
    controller's ceiling max_staleness_hard."""
    a = cfg.async_
    return a.max_staleness_hard if a.max_staleness == "auto" else a.max_staleness


def check_auto_staleness(cfg: Config) -> None:
    """`max_staleness: auto` steers by an ESS by lag (of the sequence ratios or of the IS
    weights) that the learner computes only with rollout IS on and a recomputed proximal
    policy (in bypass the proximal policy is the behaviour: every ratio is 1)."""
    a, alg = cfg.async_, cfg.algorithm
    if a.max_staleness != "auto":
        if a.target_kl is not None:
            raise ConfigError(
                f"async.target_kl steers max_staleness: auto, but the bound is fixed at "
                f"{a.max_staleness}: set max_staleness: auto, or target_kl: null"
            )
        if a.staleness_signal != "sequence":
            raise ConfigError(
                f"async.staleness_signal steers max_staleness: auto, but the bound is fixed at "
                f"{a.max_staleness}: set max_staleness: auto, or leave staleness_signal unset"
            )
        return
    if a.max_staleness_hard < 1:
        raise ConfigError(
            "async.max_staleness: auto moves the bound between 0 and async.max_staleness_hard, "
            f"which is {a.max_staleness_hard}: set it >= 1, or use max_staleness: 0"
        )
    if not 0.0 < a.target_ess <= 1.0:
        raise ConfigError(f"async.target_ess must be in (0, 1], got {a.target_ess}")
    if a.target_kl is not None and not a.target_kl > 0.0:
        raise ConfigError(f"async.target_kl must be > 0 (null: the ESS alone), got {a.target_kl}")
    if alg.rollout_is_threshold is None or alg.correction_mode == "bypass":
        raise ConfigError(
            "async.max_staleness: auto steers by the ESS by lag the learner reports with "
            "rollout IS, which this config does not compute: set algorithm.rollout_is_threshold and "
            "algorithm.correction_mode: decoupled, or give max_staleness a number"
        )


def max_response_tokens(cfg: Config) -> int:
    """Most tokens one response may reach: an episode's response_length, else max_new_tokens
    (or response_length)."""
    if cfg.env is not None:
        return cfg.response_length
    return cfg.actor_infer.generating_args.max_new_tokens or cfg.response_length


def check_token_budget(cfg: Config) -> None:
    """`max_inflight_tokens` below one batch's worst case could deadlock: the learner takes a
    whole batch of buffered groups, all of them counted until taken."""
    limit = cfg.async_.max_inflight_tokens
    if not limit:
        return
    positive("async.max_inflight_tokens", limit)
    batch, n = cfg.rollout_batch_size, cfg.num_return_sequences_in_group
    prompt, response = cfg.prompt_length, max_response_tokens(cfg)
    need = batch * n * (prompt + response)
    if limit < need:
        raise ConfigError(
            f"async.max_inflight_tokens ({limit}) is below one batch at its worst case, "
            f"rollout_batch_size {batch} x n {n} x (prompt_length {prompt} + {response} "
            f"response tokens) = {need}: the learner could wait for a batch that never fits"
        )


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
    if a.max_staleness != "auto" and a.max_staleness_hard < a.max_staleness:
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

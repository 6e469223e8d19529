"""Checks of how weights reach the engines (`async.pause_mode`). Each failure is one
ConfigError line naming the key."""

from __future__ import annotations

from asyncrl.config.schema import Config, ConfigError


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


def check_overlap(cfg: Config) -> None:
    """`weight_sync.overlap: always` opens admission for a version only once its sync lands, while
    the learner already trains on: `stale_policy: wait` would gate on the older version."""
    if cfg.weight_sync.overlap == "always" and cfg.async_.stale_policy == "wait":
        raise ConfigError(
            "weight_sync.overlap: always with async.stale_policy: wait: the wait gate reads the "
            "version admission opened, which an overlapped sync opens late; use never or auto"
        )

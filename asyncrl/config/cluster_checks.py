"""Checks of the `cluster` section (one host or a multi-node Ray cluster). Each failure is one
ConfigError line naming the key: a multi-node run whose parts would bind or advertise loopback
(unreachable from the other nodes) is refused here, not found out as a hang at start-up."""

from __future__ import annotations

import math
import re

from asyncrl.config.schema import Config, ConfigError
from asyncrl.net import is_loopback

#: Bind addresses meaning every interface (each node's engines are reached at its address).
WILDCARDS = ("0.0.0.0", "::", "[::]")
#: Resources asyncrl sets itself in an engine's bundle.
OWN_RESOURCES = ("CPU", "GPU")
#: Environment variables asyncrl sets per learner rank (cluster.learner_env may not).
OWN_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")  # fmt: skip
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_cluster(cfg: Config) -> None:
    """Addresses and bundles of the cluster section; multi-node needs routable binds."""
    cl = cfg.cluster
    if not cl.bind_host.strip():
        raise ConfigError("cluster.bind_host must name an address, got an empty string")
    for name in ("engine_bundle", "learner_bundle"):
        _check_bundle(name, getattr(cl, name))
    _check_learner_env(cl.learner_env)
    t = cl.collective_timeout_s
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 1:
        raise ConfigError(
            f"cluster.collective_timeout_s must be a number of seconds >= 1, got {t!r}"
        )
    if any(
        isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in cl.accelerators_per_node
    ):
        raise ConfigError(
            f"cluster.accelerators_per_node must list ints >= 0, got {cl.accelerators_per_node!r}"
        )
    host = cfg.actor_infer.strategy_args.strategy_config.get("host")
    if host is not None and str(host) != cl.bind_host and cl.bind_host != "127.0.0.1":
        raise ConfigError(
            f"actor_infer.strategy_args.strategy_config.host {host!r} contradicts "
            f"cluster.bind_host {cl.bind_host!r}: set one"
        )
    if cl.address.strip():
        if cfg.rollout.worker_pool != "ray":
            raise ConfigError(
                f"rollout.worker_pool {cfg.rollout.worker_pool!r} with cluster.address: a "
                "multi-node run's rollout workers are Ray actors beside their engines (set ray)"
            )
        _check_multinode(cfg)
        return
    # Read only where engines and ranks are placed: a value the run would ignore is refused.
    placed = [k for k in ("engine_bundle", "learner_bundle") if getattr(cl, k)]
    placed += ["placement_strategy"] if cl.placement_strategy != "SPREAD" else []
    placed += ["accelerators_per_node"] if cl.accelerators_per_node else []
    if placed:
        raise ConfigError(
            f"cluster.{placed[0]} places parts of the run on a Ray cluster: set cluster.address "
            "(multi-node)"
        )


def _check_bundle(name: str, bundle: dict) -> None:
    for key, amount in bundle.items():
        if key in OWN_RESOURCES:
            raise ConfigError(
                f"cluster.{name}.{key} is set by asyncrl (engines: GPU = num_gpus_per_worker, "
                "else CPU 1; learner ranks: CPU 1); name custom resources only"
            )
        if not isinstance(amount, int | float) or not math.isfinite(amount) or amount <= 0:
            raise ConfigError(f"cluster.{name}.{key} must be a number > 0, got {amount!r}")


def _check_learner_env(env: dict) -> None:
    for key, value in env.items():
        if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
            raise ConfigError(
                f"cluster.learner_env key {key!r} is not an environment variable name"
            )
        if key in OWN_RANK_ENV:
            raise ConfigError(
                f"cluster.learner_env.{key} is set by asyncrl for each rank (its placement): "
                "remove it"
            )
        if (
            not isinstance(value, str | int | float)
            or isinstance(value, bool)
            or "\0" in str(value)
        ):
            raise ConfigError(f"cluster.learner_env.{key} must be a string, got {value!r}")


def _check_multinode(cfg: Config) -> None:
    cl, what = cfg.cluster, f"cluster.address={cfg.cluster.address!r} (multi-node)"
    if cl.bind_host not in WILDCARDS:
        raise ConfigError(
            f"{what}: cluster.bind_host {cl.bind_host!r} cannot be bound on every node: "
            "set 0.0.0.0 (each engine is then reached at its node's address)"
        )
    if is_loopback(cfg.rollout.transport_host):
        raise ConfigError(
            f"{what}: rollout.transport_host {cfg.rollout.transport_host!r} is loopback, "
            "rollout workers on other nodes cannot reach it: set 0.0.0.0 or this node's address"
        )
    _check_learner_plan(cfg, what)
    if cfg.actor_infer.strategy_args.strategy_config.get("server_urls"):
        raise ConfigError(
            f"{what}: actor_infer.strategy_args.strategy_config.server_urls attaches running "
            "servers, which are not placed: remove cluster.address or server_urls"
        )


def _check_learner_plan(cfg: Config, what: str) -> None:
    """`cluster.accelerators_per_node`, when given, must place the learner's ranks (the plan
    `config show` prints; `asyncrl.config.rank_plan.py`)."""
    from asyncrl.config.rank_plan import RankPlanError, node_group_size, plan_ranks

    cl, train = cfg.cluster, cfg.actor_train
    if not cl.accelerators_per_node:
        return
    sa = train.strategy_args
    try:
        plan_ranks(len(train.device_mapping), node_group_size(sa.strategy_name, sa.strategy_config),
                   cl.accelerators_per_node)  # fmt: skip
    except RankPlanError as e:
        raise ConfigError(f"{what}: cluster.accelerators_per_node: {e}") from None

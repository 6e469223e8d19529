"""Checks of the `cluster` section (one host or a multi-node Ray cluster). Each failure is one
ConfigError line naming the key: a multi-node run whose parts would bind or advertise loopback
(unreachable from the other nodes) is refused here, not found out as a hang at start-up."""

from __future__ import annotations

import math

from asyncrl.config.schema import Config, ConfigError
from asyncrl.net import is_loopback

#: Bind addresses meaning every interface (each node's engines are reached at its address).
WILDCARDS = ("0.0.0.0", "::", "[::]")
#: Resources asyncrl sets itself in an engine's bundle.
OWN_RESOURCES = ("CPU", "GPU")


def check_cluster(cfg: Config) -> None:
    """Addresses and bundles of the cluster section; multi-node needs routable binds."""
    cl = cfg.cluster
    if not cl.bind_host.strip():
        raise ConfigError("cluster.bind_host must name an address, got an empty string")
    for name in ("engine_bundle", "learner_bundle"):
        _check_bundle(name, getattr(cl, name))
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
    n = len(cfg.actor_train.device_mapping)
    if n > 1 and cfg.actor_train.strategy_args.strategy_name != "fsdp2_train":
        raise ConfigError(
            f"{what}: {cfg.actor_train.strategy_args.strategy_name} on {n} devices is not "
            "placed across nodes yet (its ranks take the driver node's devices): use one "
            "device, or fsdp2_train"
        )
    if cfg.actor_infer.strategy_args.strategy_config.get("server_urls"):
        raise ConfigError(
            f"{what}: actor_infer.strategy_args.strategy_config.server_urls attaches running "
            "servers, which are not placed: remove cluster.address or server_urls"
        )

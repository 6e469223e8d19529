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
    for key, amount in cl.engine_bundle.items():
        if key in OWN_RESOURCES:
            raise ConfigError(
                f"cluster.engine_bundle.{key} is set by asyncrl (GPU: num_gpus_per_worker, "
                "else CPU 1); name custom resources only"
            )
        if not isinstance(amount, int | float) or not math.isfinite(amount) or amount <= 0:
            raise ConfigError(f"cluster.engine_bundle.{key} must be a number > 0, got {amount!r}")
    host = cfg.actor_infer.strategy_args.strategy_config.get("host")
    if host is not None and str(host) != cl.bind_host and cl.bind_host != "127.0.0.1":
        raise ConfigError(
            f"actor_infer.strategy_args.strategy_config.host {host!r} contradicts "
            f"cluster.bind_host {cl.bind_host!r}: set one"
        )
    if cl.address.strip():
        _check_multinode(cfg)
        return
    # Read only where engines are placed: a value the run would ignore is refused instead.
    if cl.placement_strategy != "SPREAD" or cl.engine_bundle:
        key = "engine_bundle" if cl.engine_bundle else "placement_strategy"
        raise ConfigError(
            f"cluster.{key} places engines on a Ray cluster: set cluster.address (multi-node)"
        )


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
    if len(cfg.actor_train.device_mapping) > 1:
        raise ConfigError(
            f"{what}: actor_train on {len(cfg.actor_train.device_mapping)} devices is not "
            "placed across nodes yet (learner ranks rendezvous on loopback): use one device"
        )
    if cfg.actor_infer.strategy_args.strategy_config.get("server_urls"):
        raise ConfigError(
            f"{what}: actor_infer.strategy_args.strategy_config.server_urls attaches running "
            "servers, which are not placed: remove cluster.address or server_urls"
        )

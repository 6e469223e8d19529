"""Engines on a Ray cluster: one Ray actor per engine, placed in a placement group (one bundle
per engine), starting its server on ITS node and advertising it at that node's address.

The fleet keeps driving engines by URL (health, relaunch, weight sync) exactly as on one host:
`PlacedLauncher` satisfies `EngineLauncher`, and the handle it returns answers `proc.poll()`,
`stop()` and `kill()` through the engine's actor (`PlacedProcess`). Each actor builds the
backend's own launcher (`factory`: hf or sglang, the same code as on one host) and calls it
on its node, so the server process is the actor's child: it dies with the actor
(`engine/process.py`), and the actor dies with the driver (Ray's ownership).

Resources per bundle: CPU 1, plus `tp_size` accelerators (Ray's GPU or NPU) on accelerator
clusters, plus `cluster.engine_bundle`'s custom resources. An engine's accelerators are the ones
Ray assigned to its actor, not indices of the driver's devices.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.config.schema import ClusterConfig
from asyncrl.engine.process import EngineLaunchError, ServerHandle
from asyncrl.net import advertised_host, init_ray, is_loopback

#: How long the driver waits for an engine's placement group (the cluster may be scaling up).
PLACEMENT_TIMEOUT_S = 300.0
#: Longest wait for a placed engine to report its server up (SGLang's own limit is 900 s).
LAUNCH_TIMEOUT_S = 1800.0
#: An actor that does not answer a liveness poll within this is taken as alive but busy.
POLL_TIMEOUT_S = 10.0


class EngineHost:
    """The Ray actor of one engine: builds the backend launcher on its node, starts, polls,
    stops the server. Methods run one at a time on the actor's one thread, which is also the
    thread the server's die-with-parent request is tied to."""

    def __init__(self, factory: Callable[[], Any], device_resource: str | None) -> None:
        self.launcher = factory()
        self.handle: ServerHandle | None = None
        if device_resource is not None:  # the devices Ray gave this actor, not the driver's
            import ray

            ids = ray.get_runtime_context().get_accelerator_ids().get(device_resource, [])
            devices = [int(i) for i in ids]
            self.launcher.devices = [devices] * len(getattr(self.launcher, "devices", [1]))

    def launch(self, index: int, port: int | None) -> tuple[str, int]:
        """Start the server (a previous one is killed first); its advertised URL and pid."""
        if self.handle is not None:
            self.handle.kill()
        self.handle = self.launcher.launch(index, port)
        return self.handle.url, self.handle.proc.pid

    def node(self) -> tuple[str, str]:
        """(Ray node id, node IP) of this actor: where its server runs."""
        import ray

        return ray.get_runtime_context().get_node_id(), advertised_host("0.0.0.0")

    def poll(self) -> int | None:
        return None if self.handle is None else self.handle.proc.poll()

    def stop(self, timeout_s: float) -> None:
        if self.handle is not None:
            self.handle.stop(timeout_s)

    def kill(self) -> None:
        if self.handle is not None:
            self.handle.kill()


class PlacedProcess:
    """Stands in for the Popen of a server on another node: asks its actor. A dead actor (its
    node lost) reads as an exited server, so the fleet relaunches it."""

    owned = True

    def __init__(self, actor: Any, pid: int) -> None:
        self.actor, self.pid, self.returncode = actor, pid, None

    def poll(self) -> int | None:
        import ray

        try:
            self.returncode = ray.get(self.actor.poll.remote(), timeout=POLL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            return None  # busy (launching, stopping), not known dead
        except ray.exceptions.RayError:
            self.returncode = -9
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode

    def stop(self, timeout_s: float) -> None:
        self._call("stop", timeout_s, wait_s=timeout_s + 10)

    def kill(self) -> None:
        self._call("kill", wait_s=30)

    def _call(self, method: str, *args: Any, wait_s: float) -> None:
        import ray

        try:
            ray.get(getattr(self.actor, method).remote(*args), timeout=wait_s)
        except ray.exceptions.RayError:  # the actor (and with it its server) is gone already
            pass


class PlacedLauncher:
    """`EngineLauncher` over Ray: `local` is the backend's launcher on the driver (counts,
    device, key, router); `factory` builds the same launcher inside each engine's actor."""

    def __init__(self, local: Any, factory: Callable[[], Any], cluster: ClusterConfig) -> None:
        if not is_loopback(cluster.bind_host) and not local.api_key:
            raise EngineLaunchError(
                f"engines would bind {cluster.bind_host} without an API key: refused"
            )
        import ray
        from ray.util.placement_group import placement_group

        init_ray(cluster.address)
        self._ray, self.local, self.factory = ray, local, factory
        self.num_engines, self.tp_size = local.num_engines, local.tp_size
        self.device, self.api_key = local.device, local.api_key
        resource = local.device.ray_resource
        self.bundle: dict[str, float] = {"CPU": 1.0, **cluster.engine_bundle}
        if resource is not None:
            self.bundle[resource] = float(self.tp_size)
        self.pg = placement_group(
            [dict(self.bundle)] * self.num_engines, cluster.placement_strategy
        )
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.pg)
            raise EngineLaunchError(
                f"no room in the Ray cluster for {self.num_engines} engine bundle(s) of "
                f"{self.bundle} ({cluster.placement_strategy}) within {PLACEMENT_TIMEOUT_S:.0f}s"
            ) from None
        self.actors: list[Any] = [None] * self.num_engines

    def actor_options(self, index: int) -> dict[str, Any]:
        """Ray options that place an actor in engine `index`'s bundle (its node)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index)
        return {"scheduling_strategy": strategy}

    def _actor(self, index: int) -> Any:
        """Engine `index`'s actor; a new one in the same bundle if the old one is gone."""
        actor = self.actors[index]
        if actor is not None and self._responds(actor):
            return actor
        if actor is not None:  # frees its bundle's resources for the replacement
            self._ray.kill(actor, no_restart=True)
        extra = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        opts = {"num_cpus": self.bundle["CPU"], "num_gpus": self.bundle.get("GPU", 0)}
        opts |= {"resources": extra, "max_restarts": 0, **self.actor_options(index)}
        device = self.device.ray_resource
        self.actors[index] = (
            self._ray.remote(EngineHost).options(**opts).remote(self.factory, device)
        )
        return self.actors[index]

    def _responds(self, actor: Any) -> bool:
        """False once the actor is dead (its node lost, killed); a busy one counts as alive."""
        try:
            self._ray.get(actor.node.remote(), timeout=POLL_TIMEOUT_S)
        except self._ray.exceptions.GetTimeoutError:
            return True
        except self._ray.exceptions.RayError:
            return False
        return True

    def launch(self, index: int, port: int | None = None) -> ServerHandle:
        actor = self._actor(index)
        try:  # the backend's own launch timeout bounds this; ours only guards a lost reply
            url, pid = self._ray.get(actor.launch.remote(index, port), timeout=LAUNCH_TIMEOUT_S)
        except self._ray.exceptions.GetTimeoutError:
            raise EngineLaunchError(
                f"engine {index} did not start within {LAUNCH_TIMEOUT_S:.0f}s"
            ) from None
        except self._ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None) or e
            raise EngineLaunchError(f"engine {index}: {cause}") from None
        except self._ray.exceptions.RayError as e:
            raise EngineLaunchError(f"engine {index}'s actor died: {e}") from None
        proc = PlacedProcess(actor, pid)
        return ServerHandle(proc, url, _nowhere())  # type: ignore[arg-type]

    def nodes(self) -> list[tuple[str, str]]:
        """(Ray node id, node IP) of every engine's actor."""
        return self._ray.get([self._actor(i).node.remote() for i in range(self.num_engines)])

    def actor_urls(self, worker_urls: list[str]) -> list[str]:
        return self.local.actor_urls(worker_urls)  # the router, if any, runs on the driver

    def routes(self, engines: int) -> bool:
        return self.local.routes(engines)

    def close(self) -> None:
        self.local.close()
        for actor in self.actors:
            if actor is not None:
                self._ray.kill(actor, no_restart=True)
        self._ray.util.remove_placement_group(self.pg)


def _nowhere() -> Path:
    """The log of a placed engine lives on its node (engine_logs there); none is read here."""
    return Path(os.devnull)

"""Start asyncrl's hf engine server as a subprocess and wait until it can generate; the
`hf_infer` launcher of the engine fleet."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.config.schema import WorkerConfig
from asyncrl.config.strategy_keys import strategy_option
from asyncrl.device import SPECS
from asyncrl.engine.process import API_KEY_ENV, EngineLaunchError, ServerHandle, popen
from asyncrl.net import advertised_host, free_port, url_host
from asyncrl.threads import ThreadShare

#: Sequences one hf engine decodes together unless `strategy_config.max_batch_size` says: room
#: for two rollout batches in flight (max_staleness 1) beside a held-out evaluation, which then
#: runs in a few wide decode steps instead of waiting for slots (the default run's evaluation:
#: 200 -> 145 ms, the learner's stall at the sync after it 167 -> 112 ms).
HF_MAX_BATCH = 256


def launch_hf_server(
    model_path: str | os.PathLike,
    port: int | None = None,
    dtype: str = "fp32",
    *,
    timeout_s: float = 120.0,
    **options: Any,
) -> ServerHandle:
    """Start `python -m asyncrl.engine.hf.server` and wait until /health_generate is 200:
    `spawn_hf_server` (`options` are its keyword arguments), then `wait_healthy`."""
    return wait_healthy(spawn_hf_server(model_path, port, dtype, **options), timeout_s)


def spawn_hf_server(
    model_path: str | os.PathLike,
    port: int | None = None,
    dtype: str = "fp32",
    *,
    host: str = "127.0.0.1",
    max_batch_size: int = 32,
    seed: int = 0,
    extra_args: Sequence[str] = (),
    log_dir: str | os.PathLike | None = None,
    api_key: str | None = None,
) -> ServerHandle:
    """Start `python -m asyncrl.engine.hf.server` and return at once (its URL is known; it is
    not ready before `wait_healthy`).

    `api_key`: the server then wants `Authorization: Bearer <api_key>` on every call but
    /health*; it travels in the child's environment (ASYNCRL_API_KEY), never on its command
    line. The server dies with this process (see `engine/process.py`).
    """
    port = port or free_port(host)
    scratch = None if log_dir else Path(tempfile.mkdtemp(prefix="asyncrl-hf-server-"))
    log_dir = Path(log_dir or scratch)  # type: ignore[arg-type]
    log_path = log_dir / f"hf_server_{port}.log"
    cmd = [sys.executable, "-m", "asyncrl.engine.hf.server", "--model-path", str(model_path)]
    cmd += ["--host", host, "--port", str(port), "--dtype", dtype]
    cmd += ["--max-batch-size", str(max_batch_size), "--seed", str(seed), *extra_args]
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}  # None: no auth, really
    if api_key:
        env[API_KEY_ENV] = api_key
    with open(log_path, "wb") as log:
        proc = popen(cmd, env, log)
    # Reached at the node's address when bound to every interface (multi-node), else at `host`.
    url = f"http://{url_host(advertised_host(host))}:{port}"
    return ServerHandle(proc, url, log_path, scratch)


def wait_healthy(handle: ServerHandle, timeout_s: float = 120.0) -> ServerHandle:
    """Wait until the server's /health_generate is 200. Raises EngineLaunchError with the
    server's log tail if it exits or is not healthy in time (the server is then stopped)."""
    proc, port = handle.proc, handle.url.rsplit(":", 1)[1]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = handle.log_tail()
            handle.kill()  # reaps its process group and removes its scratch dir
            raise EngineLaunchError(
                f"hf server on port {port} exited with code {proc.returncode}; log tail:\n" + tail
            )
        try:
            with urllib.request.urlopen(handle.url + "/health_generate", timeout=5) as r:
                if r.status == 200:
                    return handle
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    tail = handle.log_tail()  # before stop() removes a scratch log dir
    handle.stop()
    raise EngineLaunchError(
        f"hf server on port {port} not healthy after {timeout_s:.0f}s; log tail:\n" + tail
    )


class HFLauncher:
    """asyncrl's own transformers server (`hf_infer`): one CPU process per engine, bound to
    `host` (loopback unless `cluster.bind_host` says otherwise). `threads[i]`: engine i's share
    of the run's thread budget (`threads.plan_threads`; empty: torch's default, unpinned)."""

    def __init__(
        self,
        infer: WorkerConfig,
        model_dir: Path,
        log_dir: Path,
        seed: int,
        api_key: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.infer, self.model_dir, self.log_dir, self.seed = infer, model_dir, log_dir, seed
        self.api_key, self.host = api_key, host
        self.num_engines = max(1, len(infer.device_mapping) // infer.num_gpus_per_worker)
        self.tp_size = 1
        self.device = SPECS["cpu"]
        self.threads: Sequence[ThreadShare] = ()

    def launch(self, index: int, port: int | None = None) -> ServerHandle:
        """Start engine `index` and wait until it can generate (a relaunch: the same share)."""
        return self.wait_ready(self.spawn(index, port))

    def spawn(self, index: int, port: int | None = None) -> ServerHandle:
        """Start engine `index` without waiting for it (`wait_ready`): the fleet starts every
        engine, and the rollout workers, while the models load."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        share = self.threads[index] if index < len(self.threads) else ThreadShare()
        return spawn_hf_server(
            self.model_dir,
            port=port,
            host=self.host,
            dtype=self.infer.model_args.dtype or "fp32",
            max_batch_size=int(
                strategy_option(
                    "actor_infer", self.infer.strategy_args, "max_batch_size", HF_MAX_BATCH
                )
            ),  # fmt: skip
            seed=self.seed + index,
            extra_args=share.args(),
            log_dir=self.log_dir,
            api_key=self.api_key,
        )

    def wait_ready(self, handle: ServerHandle) -> ServerHandle:
        return wait_healthy(handle, timeout_s=180.0)

    def actor_urls(self, worker_urls: list[str]) -> list[str]:
        return list(worker_urls)

    def routes(self, engines: int) -> bool:
        return False

    def close(self) -> None:
        pass

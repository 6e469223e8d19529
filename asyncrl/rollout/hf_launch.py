"""Start asyncrl's hf engine server as a subprocess and wait until it can generate."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class EngineLaunchError(RuntimeError):
    """An engine server process died or never became healthy."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ServerHandle:
    """A running hf server process; `stop()` it (or use it as a context manager)."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_hf_server(
    model_path: str | os.PathLike,
    port: int | None = None,
    dtype: str = "fp32",
    *,
    host: str = "127.0.0.1",
    max_batch_size: int = 32,
    seed: int = 0,
    extra_args: Sequence[str] = (),
    timeout_s: float = 120.0,
    log_dir: str | os.PathLike | None = None,
) -> ServerHandle:
    """Start `python -m asyncrl.rollout.hf_server` and wait until /health_generate is 200.

    Raises EngineLaunchError with the server's log tail if it exits or is not healthy in time.
    """
    port = port or free_port(host)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="asyncrl-hf-server-"))
    log_path = log_dir / f"hf_server_{port}.log"
    cmd = [sys.executable, "-m", "asyncrl.rollout.hf_server", "--model-path", str(model_path)]
    cmd += ["--host", host, "--port", str(port), "--dtype", dtype]
    cmd += ["--max-batch-size", str(max_batch_size), "--seed", str(seed), *extra_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    handle = ServerHandle(proc, f"http://{host}:{port}", log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EngineLaunchError(
                f"hf server on port {port} exited with code {proc.returncode}; log tail:\n"
                + handle.log_tail()
            )
        try:
            with urllib.request.urlopen(handle.url + "/health_generate", timeout=5) as r:
                if r.status == 200:
                    return handle
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    handle.stop()
    raise EngineLaunchError(
        f"hf server on port {port} not healthy after {timeout_s:.0f}s; log tail:\n"
        + handle.log_tail()
    )

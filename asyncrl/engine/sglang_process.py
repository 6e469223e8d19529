"""SGLang server processes: one started (its own process group, dying with the driver), one
attached to (started by someone else: never stopped by asyncrl, its tp size checked), and the
wait until either answers healthy. The router is started and waited for the same way."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from asyncrl.engine.process import EngineLaunchError, ServerHandle, popen


class AttachedProcess:
    """Stands in for the Popen of a server asyncrl did not start: never 'exits', never killed
    (`ServerHandle.stop` leaves it alone)."""

    returncode = None

    def poll(self) -> None:
        return None


def wait_healthy(handle: ServerHandle, path: str, timeout_s: float, what: str) -> ServerHandle:
    """Poll `url + path` until HTTP 200; EngineLaunchError with the log tail if the process
    exits or the deadline passes (a process we started is stopped then)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if handle.proc.poll() is not None:
            raise EngineLaunchError(
                f"{what} exited with code {handle.proc.returncode}; log tail:\n{handle.log_tail()}"
            )
        try:
            with urllib.request.urlopen(handle.url + path, timeout=10) as r:
                if r.status == 200:
                    return handle
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    if not isinstance(handle.proc, AttachedProcess):
        handle.stop()
    raise EngineLaunchError(
        f"{what} at {handle.url} not healthy ({path}) after {timeout_s:.0f}s; log tail:\n"
        + handle.log_tail()
    )


def start_process(cmd: list[str], env: Mapping[str, str], url: str, log_path: Path) -> ServerHandle:
    """Start a server (or the router): its own process group, dies with this process."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = popen(cmd, {**os.environ, **env}, log)
    return ServerHandle(proc, url, log_path)


def attach(url: str, timeout_s: float, tp_size: int, api_key: str | None = None) -> ServerHandle:
    """A handle on a running server; checks its health and (when it says) its tp size."""
    handle = ServerHandle(AttachedProcess(), url, Path(os.devnull))  # type: ignore[arg-type]
    wait_healthy(handle, "/health_generate", timeout_s, "attached sglang server")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        req = urllib.request.Request(url + "/get_server_info", headers=headers)
        with urllib.request.urlopen(req, timeout=10) as r:
            info = json.loads(r.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return handle  # older servers: nothing to check against
    if isinstance(info, dict) and info.get("tp_size") not in (None, tp_size):
        raise EngineLaunchError(
            f"attached sglang server {url} runs tp_size={info['tp_size']}, but "
            f"actor_infer.num_gpus_per_worker={tp_size}: the weight-update group needs them equal"
        )
    for key in ("dp_size", "pp_size"):
        if isinstance(info, dict) and info.get(key) not in (None, 1):
            raise EngineLaunchError(
                f"attached sglang server {url} runs {key}={info[key]}: SGLang's weight update "
                f"from the learner needs {key} 1"
            )
    return handle

"""A launched engine server process (ours or SGLang's): how it starts, its handle, its error.

Engine processes never outlive the driver that started them, however it ends:
- each starts in its own process group, so `stop()`/`kill()` reach whatever it started too
  (SGLang's scheduler processes, a fake server's ranks);
- on Linux each asks the kernel for SIGKILL when its parent dies (`PR_SET_PDEATHSIG`), which
  also covers a driver killed with SIGKILL, where no cleanup code runs. The kernel ties this to
  the *thread* that started the process: launch from a thread that lives as long as the engine
  (the run launches and heals from its main thread).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

API_KEY_ENV = "ASYNCRL_API_KEY"
"""The environment variable that hands asyncrl's hf server its API key (never its argv)."""


class EngineLaunchError(RuntimeError):
    """An engine server process died or never became healthy."""


def popen(cmd: Sequence[str], env: Mapping[str, str], log: IO[bytes]) -> subprocess.Popen:
    """Start an engine server: output to `log`, its own process group, dies with us (the
    `deathsig` wrapper sets that up and execs the command: no Python runs between fork and
    exec here, which a process with many threads must avoid)."""
    wrapped = [sys.executable, "-m", "asyncrl.engine.deathsig", str(os.getpid()), *cmd]
    return subprocess.Popen(
        wrapped,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=dict(env),
        process_group=0,
    )


@dataclass
class ServerHandle:
    """A running engine server process; `stop()` it (or use it as a context manager)."""

    proc: subprocess.Popen
    url: str
    log_path: Path
    scratch: Path | None = None
    """A directory made for this server alone (its log, when no log dir was given): removed
    once the server is stopped or killed."""

    @property
    def owned(self) -> bool:
        """Started by asyncrl (so it may be stopped and relaunched), not attached to: a local
        process, or one on another node that its Ray actor controls (`engine/placement.py`)."""
        return isinstance(self.proc, subprocess.Popen) or getattr(self.proc, "owned", False)

    @property
    def remote(self) -> bool:
        """Started by asyncrl on another node: stopped and killed through its actor."""
        return self.owned and not isinstance(self.proc, subprocess.Popen)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM to the server's process group, SIGKILL if it is still there after
        `timeout_s`; a server asyncrl did not start is left alone."""
        if not self.owned:
            return
        if self.remote:
            self.proc.stop(timeout_s)  # type: ignore[attr-defined]
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the server and anything left in its process group, and reap it."""
        if not self.owned:
            return
        if self.remote:
            self.proc.kill()
            return
        self._signal_group(signal.SIGKILL)
        self.proc.wait()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _signal_group(self, sig: int) -> None:
        try:  # the group id is the server's pid (process_group=0 at launch)
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):  # the whole group is gone already
            if self.proc.poll() is None:
                self.proc.send_signal(sig)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

"""A launched engine server process (ours or SGLang's): its handle and its launch error."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


class EngineLaunchError(RuntimeError):
    """An engine server process died or never became healthy."""


@dataclass
class ServerHandle:
    """A running engine server process; `stop()` it (or use it as a context manager)."""

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

"""`python -m asyncrl.engine.deathsig PARENT_PID CMD...`: run CMD so that it gets SIGKILL when
process PARENT_PID (the driver that launched it) dies.

The request (Linux `prctl(PR_SET_PDEATHSIG)`) survives the `execvp` into CMD. It is made here,
in a fresh interpreter, rather than by a `preexec_fn` between fork and exec: Python code run in
a child forked from a process with many threads (Ray, gloo, ZMQ, the profiler) can deadlock or
crash on a lock another thread held at the fork (the subprocess documentation's warning).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    parent, cmd = int(argv[0]), argv[1:]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGKILL)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])

"""`asyncrl run` from the command line ends without tearing the interpreter down (seconds with
torch and transformers loaded), but only once every other exit handler has run, with the
status `main` returned; a caller's `main([...])` leaves its process to end as it likes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMON = """
import atexit, sys
from asyncrl import cli

class Teardown:  # its __del__ runs only in the interpreter's teardown
    def __del__(self):
        print("torn down", flush=True)

kept = Teardown()
dispatch = cli._dispatch

def later(parser, args):  # registered after main's handler, as Ray's and logging's are
    atexit.register(lambda: print("later handler ran", flush=True))
    return dispatch(parser, args)

cli._dispatch = later
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", COMMON + code], capture_output=True, text=True, cwd=ROOT
    )


def test_the_command_line_run_skips_the_teardown_after_every_handler():
    done = _run("sys.argv = ['asyncrl', 'run', 'max_steps=-1']\nsys.exit(cli.main())")
    assert done.returncode == 2, done.stderr  # main's status: a config error
    assert "config error: max_steps" in done.stderr
    assert done.stdout.splitlines() == ["later handler ran"]  # and no teardown after it


def test_a_callers_main_leaves_the_process_to_exit_as_python_does():
    done = _run("status = cli.main(['run', 'max_steps=-1'])\nprint('status', status)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["status 2", "later handler ran", "torn down"]

"""SGLang's wheels for the contract tests: fetched, unpacked once, run in a subprocess.

`pip download --no-deps sglang==X` into `ASYNCRL_WHEEL_CACHE` (default
~/.cache/asyncrl/wheels), unpacked (Python sources and data, not the compiled kernels) next to
it. CI reaches PyPI, so a wheel that cannot be had FAILS the test; `ASYNCRL_SKIP_UPSTREAM=1`
skips instead (an offline developer machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("ASYNCRL_WHEEL_CACHE", Path.home() / ".cache/asyncrl/wheels"))
SKIP_ENV = "ASYNCRL_SKIP_UPSTREAM"
ROOT = Path(__file__).resolve().parents[2]


def _unavailable(why: str) -> None:
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{why} ({SKIP_ENV}=1)")
    pytest.fail(f"{why}; set {SKIP_ENV}=1 to skip the upstream checks on an offline machine")


def wheel_path(version: str) -> Path:
    """SGLang's wheel of `version`, from the cache or PyPI."""
    found = sorted(CACHE.glob(f"sglang-{version}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"sglang=={version}"]
        try:
            done = subprocess.run(
                [*cmd, "-d", str(CACHE)], capture_output=True, text=True, timeout=600
            )
        except subprocess.TimeoutExpired:
            _unavailable(f"pip download sglang=={version} took over 600 s")
        found = sorted(CACHE.glob(f"sglang-{version}-*.whl"))
        if not found:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            _unavailable(f"cannot download the sglang {version} wheel: {tail[0]}")
    return found[-1]


def wheel(version: str) -> zipfile.ZipFile:
    return zipfile.ZipFile(wheel_path(version))


def unpacked(version: str) -> Path:
    """The wheel's `sglang/` unpacked under the cache (once: a marker says it is complete)."""
    whl = wheel_path(version)
    target = CACHE / "unpacked" / whl.stem
    if not (target / ".complete").exists():
        with zipfile.ZipFile(whl) as z:
            names = [n for n in z.namelist() if n.startswith("sglang/") and not n.endswith(".so")]
            z.extractall(target, names)
        (target / ".complete").touch()
    return target


def run_upstream(requests: dict[str, dict]) -> dict[str, dict]:
    """Run each SGLang release's own code on its request ({version: request}; one subprocess,
    tests/fake_sglang/upstream_exec.py): {version: results}."""
    jobs = {v: {**r, "root": str(unpacked(v))} for v, r in requests.items()}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "tests.fake_sglang.upstream_exec"],
        input=json.dumps(jobs), capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": path}, cwd=ROOT,
    )  # fmt: skip
    marker = "@@RESULT@@"
    if done.returncode or marker not in done.stdout:
        raise AssertionError(
            f"SGLang's code did not run here (exit {done.returncode}):\n"
            + "\n".join(done.stderr.strip().splitlines()[-15:])
        )
    return json.loads(done.stdout.rsplit(marker, 1)[1])

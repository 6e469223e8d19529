"""A local run starts a Ray of its own, whatever cluster another process left named on the box.

Ray's `init()` without an address joins the cluster that `<RAY_TMPDIR>/ray/ray_current_cluster`
names (a `ray start`, another run) and then refuses `num_cpus`: every `asyncrl run` on the box
failed while a multi-node test's cluster was up. `net.init_ray` passes `address="local"`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def test_a_local_start_ignores_a_cluster_left_named_on_the_box():
    # Ray's socket paths under RAY_TMPDIR must stay below 108 bytes: a short directory
    tmp_path = Path(tempfile.mkdtemp(prefix="rl-", dir="/tmp"))
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("192.0.2.2:44141")  # TEST-NET: dead
    code = "import ray; from asyncrl.net import init_ray; init_ray(); print(ray.is_initialized())"
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path)}
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=180, check=False)  # fmt: skip
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("True")

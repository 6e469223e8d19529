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


THREAD_START = """
import os, threading, ray
from asyncrl.net import init_ray
t = threading.Thread(target=init_ray)  # a run on a thread of its own, which then ends
t.start()
t.join()
pid = ray.remote(num_cpus=0)(lambda: os.getpid())
print("served by", ray.get(pid.remote(), timeout=60), flush=True)
"""


def test_ray_started_from_a_thread_outlives_that_thread():
    """Ray's GCS and raylet die with the thread that spawned them (PR_SET_PDEATHSIG): a run
    on a thread that ended left the process without them, and Ray then exited the whole
    process (a pytest session died silently after `test_faults`, which runs `run` on a
    thread). Started from a thread, Ray must still serve once that thread is gone."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", THREAD_START], capture_output=True, text=True,
                          env=env, timeout=240, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "served by" in proc.stdout, proc.stderr[-2000:]

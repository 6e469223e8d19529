"""The Megatron learner placed across two Ray nodes (2 declared GPUs each, ranks computing on
the CPU through the emulation): TP2 x PP2 and TP2 x DP2 over 4 ranks, 2 per node, each tensor-
parallel pair on one node, equal to the torch learner (`tests/megatron_multinode.py`); and a
rank killed -9 ends the next step within the collective timeout (Megatron's groups included),
in one line naming it and its node. Each case starts a Ray cluster and four Megatron ranks
(minutes on a 2-core box): `slow`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.net import is_loopback

pytest.importorskip("megatron.core")
HERE = Path(__file__).resolve().parent


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 2), (2, 1)], ids=["tp2-pp2", "tp2-dp2"])
def test_megatron_ranks_on_two_nodes_match_the_torch_learner(tmp_path, tiny_model, tp, pp):
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(HERE / "megatron_multinode.py"), str(tiny_model), str(out),
           str(tp), str(pp), "4"]  # fmt: skip
    path = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": path})  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())
    # ranks 0,1 on the driver's node (rank 0 on the GPU held for it), 2,3 on the other: each
    # tensor-parallel pair (consecutive ranks) on one node
    assert result["slots"] == [[0, 0, 0], [1, 0, 1], [2, 1, 0], [3, 1, 1]]
    head, other = result["nodes"]
    assert head == result["head"] and other != head
    ranks = result["ranks"]
    assert [r["node"] for r in ranks] == [head, other, other]
    gpus = [int(r["accelerators"]["GPU"][0]) for r in ranks]
    assert gpus[0] == 1 - result["rank0_gpu"] and sorted(gpus[1:]) == [0, 1]
    assert [r["env"]["LOCAL_RANK"] for r in ranks] == ["1", "0", "1"]
    assert [r["env"]["RANK"] for r in ranks] == ["1", "2", "3"]
    assert all(not is_loopback(r["env"]["MASTER_ADDR"]) for r in ranks)
    assert result["world_size"] == 4.0
    if result["logprob_max_diff"] is not None:  # rank 0 scores when it is the last stage
        assert result["logprob_max_diff"] < 2e-5
    for key, (want, got) in result["metrics"].items():
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), key
    assert result["weight_max_diff"] < 1e-5


@pytest.mark.slow
def test_a_killed_megatron_rank_ends_the_step_naming_it_and_its_node(tmp_path, tiny_model):
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(HERE / "megatron_multinode.py"), str(tiny_model), str(out),
           "2", "1", "4", "kill"]  # fmt: skip
    path = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": path})  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())
    rank3 = result["ranks"][-1]
    where = f"rank 3 on node {rank3['node'][:12]} ({rank3['ip']})"
    assert result["lost"].startswith("LostRankError: learner " + where + " ended:"), result["lost"]
    assert "\n" not in result["lost"]

"""The Megatron learner's sharded checkpoint (megatron-core's distributed checkpointing), saved
at one parallel layout and resumed at another: the step after the resume equals the step the
saving run took after the save (weights, loss, grad norm), which a resume of the weights alone
does not (the Adam moments and step count came back). Ranks compute on the CPU through the
emulation (tests/megatron_emulation.py, tests/megatron_dist_ckpt.py); skipped without
megatron-core. The default suite runs the one-rank learner's checkpoint through the checkpoint
manager, resumed in place; the other layouts, and four ranks on two Ray nodes, are `slow`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.learner.megatron.optim_state import OptimizerLayoutError, check_reshardable

HERE = Path(__file__).resolve().parent

LEARNER = {"world": 1, "learner": True}  # MegatronLearner, through Checkpointer
DIST = {"use_distributed_optimizer": True}
CASES = {
    "learner-to-tp2": (LEARNER, {"world": 2, "tp": 2}),
    "tp2-to-pp2": ({"world": 2, "tp": 2}, {"world": 2, "pp": 2}),
    "tp2-to-learner": ({"world": 2, "tp": 2}, LEARNER),
    "learner-to-dp2": (LEARNER, {"world": 2}),
    # the distributed optimizer's state, gathered per parameter at the save, re-sliced
    "dp2-distributed-to-tp2-distributed": ({"world": 2, "extra": DIST},
                                           {"world": 2, "tp": 2, "extra": DIST}),
    # virtual pipeline chunks (four layers over 2 x 2 chunks) back into one TP2 model
    "pp2-vpp2-to-tp2": ({"world": 2, "pp": 2,
                         "extra": {"virtual_pipeline_model_parallel_size": 2}},
                        {"world": 2, "tp": 2}),
}  # fmt: skip
QUICK = ()  # each case runs two sets of Megatron processes (a minute or two): `slow`


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=() if c in QUICK else pytest.mark.slow) for c in CASES]
)
def test_a_sharded_checkpoint_resumes_onto_another_layout(tmp_path, tiny_model, case):
    pytest.importorskip("megatron.core")
    saved, resumed = CASES[case]
    result = _script(tmp_path, tiny_model, json.dumps(saved), json.dumps(resumed))
    # the bar of the Megatron learner's other equality tests (against the torch learner)
    assert result["resumed_weight_max_diff"] < 1e-5, result
    # the moments matter: without them the same step lands elsewhere
    assert result["weights_only_weight_max_diff"] > 1e-4, result
    assert result["metrics"], result
    for key, (want, got) in result["metrics"].items():
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), key


def _script(tmp_path: Path, model: Path, *args: str) -> dict:
    """`megatron_dist_ckpt.py MODEL OUT *args` in a process of its own: its result."""
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(HERE / "megatron_dist_ckpt.py"), str(model), str(out), *args]
    path = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": path})  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


def _in_place(tmp_path: Path, model: Path, mode: str) -> dict:
    pytest.importorskip("megatron.core")
    result = _script(tmp_path, model, mode)
    assert result["resumed_weight_max_diff"] < 1e-5, result
    assert result["weights_only_weight_max_diff"] > 1e-4, result
    for key, (want, got) in result["metrics"].items():
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), key
    assert ".metadata" in result["shard_files"]  # Megatron's torch_dist, complete
    # a state saved with the other optimizer kind: refused in one line, before any load
    assert "use_distributed_optimizer True and this run has False" in result["refused"]
    assert "\n" not in result["refused"]
    return result


def test_a_one_rank_megatron_learner_resumes_its_checkpoint_through_the_manager(
    tmp_path, tiny_model
):
    """MegatronLearner on one rank: an async checkpoint through `Checkpointer` (its shards by
    Megatron's distributed checkpointing), resumed through `find` + `apply`."""
    _in_place(tmp_path, tiny_model, "one")


@pytest.mark.slow
def test_a_megatron_learner_on_two_nodes_saves_its_shards_and_resumes(tmp_path, tiny_model):
    """MegatronLearner at TP2 x PP2 over four ranks on two Ray nodes (ranks 1-3 Ray actors):
    output_dir checked shared at start, an async checkpoint through the manager with every
    rank writing its shards, resumed through `find` + `apply`."""
    result = _in_place(tmp_path, tiny_model, "ray")
    assert result["shared_checked"] == [True] * 4, result
    writers = {f.split("_")[2] for f in result["shard_files"] if f.endswith(".distcp")}
    assert writers == {"0", "1", "2", "3"}, result  # torch_dist files: __<rank>_<n>.distcp


def test_the_distributed_and_the_regular_optimizer_state_do_not_load_into_each_other():
    layout = {"world": 2, "tensor_model_parallel_size": 2, "distributed_optimizer": False}
    # another split, another rank count: Megatron reshards
    check_reshardable(layout, {**layout, "world": 1, "tensor_model_parallel_size": 1})
    check_reshardable(None, layout)  # a state without its layout: nothing to check
    for saved, now in ((True, False), (False, True)):
        with pytest.raises(OptimizerLayoutError) as err:
            check_reshardable({**layout, "distributed_optimizer": saved},
                              {**layout, "distributed_optimizer": now})  # fmt: skip
        message = str(err.value)
        assert "\n" not in message
        assert f"use_distributed_optimizer {saved} and this run has {now}" in message
        assert "load_contents without 'optimizer'" in message

"""A resumed run rewinds its W&B run to the checkpoint's step, as it rolls back its files.

The edge faked is the `wandb` package (a module that records `wandb.init`'s arguments and
each run's rows, and can refuse rewind or fork the way an account without those preview
features would); the sink, the run record and the roll-back are the real code.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from asyncrl.checkpoint import Checkpointer
from asyncrl.metrics.rundir import claim_output_dir, move_run_aside, roll_back
from asyncrl.metrics.sinks import WANDB_RUN_FILE, WandbSink, read_wandb_record
from tests.test_restart import checkpoint_cfg, save_steps


class FakeRun:
    def __init__(self, run_id: str) -> None:
        self.id, self.rows, self.finished = run_id, [], False

    def log(self, row: dict, step: int) -> None:
        self.rows.append((step, row))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def wandb(monkeypatch):
    """A fake `wandb` module: `inits` holds each call's kwargs; `refuse` the kwargs it fails."""
    mod = types.ModuleType("wandb")
    mod.inits, mod.refuse = [], set()

    def init(**kwargs):
        mod.inits.append(kwargs)
        if mod.refuse & kwargs.keys():
            raise RuntimeError("this feature is in private preview\ncontact support")
        if "id" in kwargs:
            return FakeRun(kwargs["id"])
        return FakeRun(kwargs.get("resume_from", "").split("?")[0] or f"run{len(mod.inits)}")

    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return mod


def _sink(out: Path) -> WandbSink:
    return WandbSink("proj", "name", {"lr": 1.0}, out)


def _crashed_run(out: Path) -> Checkpointer:
    """A run that logged steps 1..4 to W&B and metrics.jsonl, checkpointed 1..3, then died."""
    ckpt = save_steps(out, 1, 2, 3)
    sink = _sink(out)
    for step in (1, 2, 3, 4):
        sink.write(step, {"loss": float(step)})
    rows = [json.dumps({"step": s, "time": float(s)}) for s in (1, 2, 3, 4)]
    (out / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return ckpt  # no close(): the driver was killed


def test_a_fresh_run_records_its_wandb_run(tmp_path, wandb):
    sink = _sink(tmp_path)
    assert wandb.inits == [{"project": "proj", "name": "name", "config": {"lr": 1.0},
                            "dir": str(tmp_path)}]  # fmt: skip
    assert read_wandb_record(tmp_path) == {"id": "run1", "project": "proj"}
    sink.close()


def test_resume_rewinds_the_wandb_run_to_the_checkpoint_step(tmp_path, wandb):
    ckpt = _crashed_run(tmp_path)
    found = claim_output_dir(tmp_path, ckpt, checkpoint_cfg(resume="auto"))
    assert found.step == 3
    roll_back(tmp_path, ckpt, found)
    sink = _sink(tmp_path)
    # W&B's own rewind to the step after the checkpoint's: steps 1..3 stay, 4 is logged anew
    assert wandb.inits[-1]["resume_from"] == "run1?_step=4"
    assert "id" not in wandb.inits[-1] and "resume" not in wandb.inits[-1]
    assert read_wandb_record(tmp_path) == {"id": "run1", "project": "proj"}  # rewound once
    sink.close()
    # a restart with nothing rolled back continues the same run
    _sink(tmp_path).close()
    assert wandb.inits[-1]["id"] == "run1" and wandb.inits[-1]["resume"] == "allow"


def test_an_account_without_rewind_forks_at_the_step_and_records_the_fork(tmp_path, wandb, capsys):
    ckpt = _crashed_run(tmp_path)
    roll_back(tmp_path, ckpt, ckpt.open(ckpt.root / "step_2"))
    wandb.refuse = {"resume_from"}
    sink = _sink(tmp_path)
    assert wandb.inits[-1]["fork_from"] == "run1?_step=3"
    said = capsys.readouterr().out
    assert "could not rewind run run1 (resume_from: this feature is in private preview)" in said
    assert read_wandb_record(tmp_path)["id"] == sink._run.id
    sink.close()


def test_neither_rewind_nor_fork_starts_a_new_run_and_says_so(tmp_path, wandb, capsys):
    ckpt = _crashed_run(tmp_path)
    roll_back(tmp_path, ckpt, ckpt.open(ckpt.root / "step_3"))
    wandb.refuse = {"resume_from", "fork_from"}
    _sink(tmp_path).close()
    assert set(wandb.inits[-1]) == {"project", "name", "config", "dir"}
    assert "could neither rewind nor fork run run1 at step 3" in capsys.readouterr().out


def test_overwrite_moves_the_wandb_record_aside(tmp_path, wandb):
    _sink(tmp_path).close()
    moved = move_run_aside(tmp_path)
    assert (moved / WANDB_RUN_FILE).exists() and read_wandb_record(tmp_path) is None

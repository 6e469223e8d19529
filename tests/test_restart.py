"""Restarting into an output_dir (issue 14, finding 3): a run owns its output_dir; a resume
rolls the logs back to the checkpoint it takes; only a complete checkpoint is taken; a
checkpoint without the run state resumes the learner only when that is asked for.

Each test copies one finished 2-step run (checkpoints at steps 1 and 2) and restarts it for
one more step through the real loop (Ray, engine server, ZMQ, learner); nothing is faked.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from asyncrl.checkpoint import Checkpointer, ResumeError, load_msgpack
from asyncrl.config import ConfigError
from asyncrl.config.schema import CheckpointConfig
from asyncrl.metrics.rundir import claim_output_dir, roll_back
from asyncrl.run import run
from tests.test_e2e import shrunk

AUTO = "actor.checkpoint.resume=auto"


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def trained_steps(out: Path) -> list[int]:
    """Steps of the metrics rows the loop writes after training (eval-only rows have no
    version); each must appear once."""
    return [r["step"] for r in rows(out / "metrics.jsonl") if r.get("version") is not None]


def audit(out: Path) -> tuple[list[int], list[str]]:
    got = rows(out / "trained_groups.jsonl")
    return [r["step"] for r in got], [i for r in got for i in r["ids"]]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(out: Path) -> dict[str, str]:
    """Every file of a run directory (hidden folders aside), by content."""
    return {
        str(p.relative_to(out)): digest(p)
        for p in sorted(out.rglob("*"))
        if p.is_file() and not p.relative_to(out).parts[0].startswith(".")
    }


@pytest.fixture(scope="module")
def finished_run(tiny_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished-run")
    run(shrunk(tiny_model, out, "max_steps=2", "actor.checkpoint.save_interval=1"))
    return out


def copy_of(finished_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    return out


def test_fresh_run_into_a_used_output_dir_refuses_and_overwrite_moves_it_aside(
    tiny_model, finished_run, tmp_path
):
    out = copy_of(finished_run, tmp_path)
    before = snapshot(out)
    cfg = shrunk(tiny_model, out, "max_steps=2")
    with pytest.raises(ConfigError, match="holds a run") as info:
        run(cfg)
    message = str(info.value)
    assert "\n" not in message and AUTO in message and "--overwrite" in message
    assert snapshot(out) == before  # refused before touching anything

    run(cfg, overwrite=True)
    aside = list(out.glob(".overwritten-*"))
    assert len(aside) == 1 and snapshot(aside[0]) == before  # the old run, whole
    assert trained_steps(out) == [1, 2]
    steps, ids = audit(out)
    assert steps == [1, 2] and len(ids) == len(set(ids)) == 4


def test_checkpoint_without_run_state_resumes_the_learner_only_when_asked(
    tiny_model, finished_run, tmp_path
):
    out = copy_of(finished_run, tmp_path)
    for step_dir in (out / "checkpoints").glob("step_*"):  # as saved without `extra`
        (step_dir / "extra.msgpack").unlink()
        (step_dir / "meta.json").unlink(missing_ok=True)
    kept = {p.name: digest(p / "learner.pt") for p in (out / "checkpoints").glob("step_*")}
    with pytest.raises(ConfigError, match="load_contents") as info:
        run(shrunk(tiny_model, out, "max_steps=3", AUTO))
    assert "\n" not in str(info.value) and "no run state" in str(info.value)

    learner_only = "actor.checkpoint.load_contents=[model,optimizer]"
    run(shrunk(tiny_model, out, "max_steps=3", AUTO, learner_only))
    # step and version continue from the checkpoint; the old checkpoints stay as they were
    assert trained_steps(out) == [1, 2, 3]
    assert [r["version"] for r in rows(out / "metrics.jsonl") if r["step"] == 3] == [3]
    assert audit(out)[0] == [1, 2, 3]
    assert {n: digest(out / "checkpoints" / n / "learner.pt") for n in kept} == kept
    assert load_msgpack(out / "checkpoints" / "step_3" / "extra.msgpack")["step"] == 3


def test_resume_after_a_crash_rolls_the_logs_back_to_the_checkpoint(
    tiny_model, finished_run, tmp_path, capsys
):
    out = copy_of(finished_run, tmp_path)
    # A crashed run trained steps 3..5 after its checkpoint at step 2 and died before saving.
    last = rows(out / "metrics.jsonl")[-1]
    with (out / "metrics.jsonl").open("a") as m, (out / "trained_groups.jsonl").open("a") as a:
        for s in (3, 4, 5):
            m.write(json.dumps({**last, "step": s, "version": s}) + "\n")
            a.write(json.dumps({"step": s, "ids": [f"crashed-{s}"]}) + "\n")
    capsys.readouterr()
    run(shrunk(tiny_model, out, "max_steps=3", AUTO))
    printed = capsys.readouterr().out

    assert trained_steps(out) == [1, 2, 3]
    steps, ids = audit(out)
    assert steps == [1, 2, 3] and len(ids) == len(set(ids))
    assert not [i for i in ids if i.startswith("crashed-")]
    # the console's step and version agree on every line
    shown = re.findall(r"^step (\d+)/\d+ +version (\d+)", printed, re.MULTILINE)
    assert shown and all(s == v for s, v in shown), shown
    # the rolled-back rows are kept aside, not lost
    (aside,) = out.glob(".rolled-back-*")
    assert [r["step"] for r in rows(aside / "metrics.jsonl")] == [3, 4, 5]
    assert audit(aside)[0] == [3, 4, 5]


def test_truncated_extra_falls_back_to_the_previous_complete_checkpoint(
    tiny_model, finished_run, tmp_path, capsys
):
    out = copy_of(finished_run, tmp_path)
    torn = out / "checkpoints" / "step_2" / "extra.msgpack"
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    capsys.readouterr()
    run(shrunk(tiny_model, out, "max_steps=3", AUTO))
    printed = capsys.readouterr().out

    assert re.search(r"skipped .*step_2.*extra\.msgpack", printed), printed
    assert re.search(r"resumed from \S*step_1 at step 1, version 1", printed), printed
    assert trained_steps(out) == [1, 2, 3]
    steps, ids = audit(out)
    assert steps == [1, 2, 3] and len(ids) == len(set(ids))
    final = load_msgpack(out / "checkpoints" / "step_3" / "extra.msgpack")
    assert final["step"] == 3 and final["version"] == 3
    assert (out / "checkpoints" / "latest").read_text() == "step_3"


# --- the parts, without a run -----------------------------------------------------------------


class FakeLearner:
    """The learner's checkpoint surface: a state dict of tensors and a version."""

    def __init__(self, version: int = 0) -> None:
        self.version, self.loaded = version, None

    def state_dict(self) -> dict:
        import torch

        return {"model": {"w": torch.full((2,), float(self.version))}, "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.loaded, self.version = state, int(state["version"])


def save_steps(out: Path, *steps: int, contents=("optimizer", "extra")) -> Checkpointer:
    ckpt = Checkpointer(out, list(contents))
    for step in steps:
        extra = {"prompts": {"epoch": 0, "index": step}, "queue": {"groups": []}, "version": step}
        ckpt.save(step, FakeLearner(step), extra)
    return ckpt


def checkpoint_cfg(**kw) -> CheckpointConfig:
    return CheckpointConfig(**{"save_contents": ["optimizer", "extra"], **kw})


def test_save_is_complete_or_absent_and_auto_takes_the_newest_complete(tmp_path):
    ckpt = save_steps(tmp_path, 1, 2, 3, 4)
    assert (ckpt.root / "latest").read_text() == "step_4"
    assert json.loads((ckpt.root / "step_4" / "meta.json").read_text())["step"] == 4
    (ckpt.root / ".tmp_step_5").mkdir()  # a save cut short: never a candidate
    (ckpt.root / "step_4" / "learner.pt").write_bytes(b"torn")
    (ckpt.root / "step_3" / "extra.msgpack").unlink()  # meta.json says it was saved
    torn = ckpt.root / "step_2" / "extra.msgpack"
    torn.write_bytes(torn.read_bytes()[:-5])
    found, skipped = ckpt.find("auto")
    assert found is not None and found.path.name == "step_1" and found.step == 1
    assert found.extra["prompts"]["index"] == 1
    assert [s.split(":")[0] for s in skipped] == ["step_4", "step_3", "step_2"]
    assert "learner.pt does not load" in skipped[0] and "is missing" in skipped[1]
    assert "does not unpack" in skipped[2] and "incomplete input" in skipped[2]
    learner = FakeLearner()
    assert found.apply(learner, {"extra"})["step"] == 1 and learner.version == 1
    # a named checkpoint is taken as it is, or refused in one line
    with pytest.raises(ResumeError, match=r"resume=\S*step_3: extra.msgpack is missing") as info:
        ckpt.find(str(ckpt.root / "step_3"))
    assert "\n" not in str(info.value)
    with pytest.raises(ResumeError, match="not a checkpoint"):
        ckpt.find(str(tmp_path / "nowhere"))


def test_run_state_of_another_save_is_refused(tmp_path):
    ckpt = save_steps(tmp_path, 1, 2)
    shutil.copy(ckpt.root / "step_1" / "extra.msgpack", ckpt.root / "step_2" / "extra.msgpack")
    found, skipped = ckpt.find("auto")
    assert found.step == 1 and "not from the same save" in skipped[0]


def test_checkpoint_saved_without_extra_needs_learner_only_asked(tmp_path):
    save_steps(tmp_path, 3, contents=("optimizer",))
    ckpt = Checkpointer(tmp_path, ["optimizer"])
    cfg = checkpoint_cfg(save_contents=["optimizer"], resume="auto")
    with pytest.raises(ResumeError, match="no run state") as info:
        claim_output_dir(tmp_path, ckpt, cfg)  # load_contents null: save_contents (no extra)
    assert "load_contents" in str(info.value)
    cfg = checkpoint_cfg(resume="auto", load_contents=["model", "optimizer"])
    found = claim_output_dir(tmp_path, ckpt, cfg)
    assert found.step == 3 and found.extra is None  # the step, from meta.json


def test_claim_refuses_a_taken_dir_but_not_empty_leftovers(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")  # a run that failed before its first row
    (out / "engine_logs").mkdir()
    (out / "notes.txt").write_text("mine")
    ckpt = Checkpointer(out, ["extra"])
    assert claim_output_dir(out, ckpt, checkpoint_cfg()) is None
    save_steps(out, 1)
    (ckpt.root / "step_1" / "learner.pt").unlink()
    with pytest.raises(ResumeError, match="no complete checkpoint to resume .1 incomplete"):
        claim_output_dir(out, ckpt, checkpoint_cfg(resume="auto"))
    assert "skipped checkpoint step_1: no learner.pt" in capsys.readouterr().out
    elsewhere = save_steps(tmp_path / "other", 2)
    with pytest.raises(ResumeError, match="not the one of"):
        claim_output_dir(out, ckpt, checkpoint_cfg(resume=str(elsewhere.root / "step_2")))
    inside = checkpoint_cfg(resume=str(ckpt.root / "step_1"))
    with pytest.raises(ResumeError, match="drop --overwrite"):
        claim_output_dir(out, ckpt, inside, overwrite=True)
    # overwrite: the run's files move aside whole, other files stay
    assert claim_output_dir(out, ckpt, checkpoint_cfg(resume="auto"), overwrite=True) is None
    (aside,) = out.glob(".overwritten-*")
    assert sorted(p.name for p in aside.iterdir()) == [
        "checkpoints",
        "engine_logs",
        "metrics.jsonl",
    ]
    assert sorted(p.name for p in out.iterdir()) == [aside.name, "notes.txt"]
    # a named checkpoint of another run starts an empty output_dir at its step
    new = tmp_path / "new"
    named = checkpoint_cfg(resume=str(elsewhere.root / "step_2"))
    found = claim_output_dir(new, Checkpointer(new, ["extra"]), named)
    assert found.step == 2


def test_roll_back_cuts_logs_and_later_checkpoints(tmp_path, capsys):
    ckpt = save_steps(tmp_path, 1, 2, 3)
    lines = [json.dumps({"step": s, "time": float(s)}) for s in (0, 1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "ti')
    (tmp_path / "trained_groups.jsonl").write_text(
        "".join(json.dumps({"step": s, "ids": [f"g{s}"]}) + "\n" for s in (1, 2, 3, 4))
    )
    (ckpt.root / ".tmp_step_4").mkdir()  # a save cut short
    found = ckpt.open(ckpt.root / "step_2")
    aside = roll_back(tmp_path, ckpt, found)
    assert not (ckpt.root / ".tmp_step_4").exists()
    assert [r["step"] for r in rows(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert audit(tmp_path)[0] == [1, 2]
    assert (aside / "metrics.jsonl").read_text().splitlines()[-1] == '{"step": 5, "ti'
    assert audit(aside)[0] == [3, 4]
    assert [p.name for p in ckpt.step_dirs()] == ["step_2", "step_1"]
    assert [p.name for p in (aside / "checkpoints").iterdir()] == ["step_3"]
    assert (ckpt.root / "latest").read_text() == "step_2"
    assert "rolled the run back to step 2" in capsys.readouterr().out
    assert roll_back(tmp_path, ckpt, found) is None  # nothing after step 2 any more

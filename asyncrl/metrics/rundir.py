"""One run owns its output_dir; a resume rolls the run back to the checkpoint it takes.

- A fresh run (`resume: never`) into a directory that holds a run (metrics.jsonl or
  trained_groups.jsonl with rows, summary.json, a checkpoint) is refused with one line saying
  what to do. `overwrite` first moves that run's files into `output_dir/.overwritten-<time>/`:
  nothing is deleted.
- `resume: auto` takes the newest complete checkpoint (`Checkpointer.find`) and names the ones
  it skipped; a directory that holds a run but no complete checkpoint is refused as above.
- Resuming from step k cuts the run back to k: metrics.jsonl, trained_groups.jsonl and the
  TensorBoard events keep the steps <= k, the checkpoints after k leave and `latest` names k;
  the W&B run recorded in the directory is rewound to k when the run's W&B sink opens it.
  What is cut goes to `output_dir/.rolled-back-<time>/`, so a crashed run's last steps are
  neither duplicated by the resumed run nor lost.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.checkpoint import (
    CHECKPOINT_DIR,
    EXTRA_FILE,
    Checkpointer,
    Loaded,
    ResumeError,
    load_contents,
)
from asyncrl.metrics.batch import AUDIT_FILE
from asyncrl.metrics.logger import METRICS_FILE, PLOT_DIR, SUMMARY_FILE, TENSORBOARD_DIR
from asyncrl.metrics.sinks import WANDB_RUN_FILE, mark_wandb_resume

if TYPE_CHECKING:
    from asyncrl.config.schema import CheckpointConfig

ENGINE_LOGS = "engine_logs"  # written by engine/fleet.py
RUN_ENTRIES = (
    METRICS_FILE,
    AUDIT_FILE,
    SUMMARY_FILE,
    CHECKPOINT_DIR,
    TENSORBOARD_DIR,
    PLOT_DIR,
    ENGINE_LOGS,
    WANDB_RUN_FILE,  # --overwrite starts a new W&B run too
)


def run_evidence(out: Path) -> list[str]:
    """What in `out` shows that a run trained there (the empty files of a run that failed to
    start do not count: there is nothing in them to lose)."""
    found = [n for n in (METRICS_FILE, AUDIT_FILE, SUMMARY_FILE) if _nonempty(out / n)]
    if Checkpointer(out, []).step_dirs():
        found.append(f"{CHECKPOINT_DIR}/")
    return found


def _nonempty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def _within(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def aside_dir(out: Path, kind: str) -> Path:
    """`out/.<kind>-<local time>`, not yet existing (a suffix when two land in one second)."""
    base = out / f".{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return path


def move_run_aside(out: Path) -> Path | None:
    """Move a run's files (RUN_ENTRIES) into `out/.overwritten-<time>/`; None: there were none.
    Files of other kinds in `out` stay where they are."""
    entries = [out / name for name in RUN_ENTRIES if (out / name).exists()]
    if not entries:
        return None
    dest = aside_dir(out, "overwritten")
    dest.mkdir(parents=True)
    for entry in entries:
        os.replace(entry, dest / entry.name)  # same file system: a rename, nothing copied
    return dest


def claim_output_dir(
    out: Path, ckpt: Checkpointer, checkpoint: CheckpointConfig, overwrite: bool = False
) -> Loaded | None:
    """Make `out` this run's; return the checkpoint to resume from (None: start at step 0).
    Every refusal (ResumeError, one line) comes before anything in `out` is touched."""
    resume = checkpoint.resume
    if overwrite and resume not in ("never", "auto") and _within(Path(resume), out):
        raise ResumeError(
            f"--overwrite would move the checkpoint to resume from ({resume}) aside with the "
            f"rest of {out}: drop --overwrite to continue that run"
        )
    # overwrite starts afresh: the checkpoints of the run it moves aside are not resumed
    found, skipped = (None, []) if overwrite and resume == "auto" else ckpt.find(resume)
    for reason in skipped:
        print(f"asyncrl: resume: skipped checkpoint {reason}")
    evidence = run_evidence(out) if out.is_dir() and not overwrite else []
    if evidence and (found is None or not _within(found.path, out)):
        raise ResumeError(_taken(out, evidence, resume, skipped))
    if found is not None and found.extra is None and "extra" in load_contents(checkpoint):
        raise ResumeError(
            f"checkpoint {found.path} holds no run state (no {EXTRA_FILE}: step, data position, "
            "replay queue), so resuming it would start those over from 0; to load only its "
            "learner, set actor.checkpoint.load_contents without extra (e.g. [model,optimizer])"
        )
    if overwrite and (moved := move_run_aside(out)) is not None:
        print(f"asyncrl: --overwrite: moved the earlier run's files in {out} to {moved}")
    return found


def _taken(out: Path, evidence: list[str], resume: str, skipped: list[str]) -> str:
    held = f"output_dir {out} already holds a run ({', '.join(evidence)})"
    aside = f"{out}/.overwritten-<time>/"
    fresh = f"start over with `asyncrl run --overwrite` (moves its files to {aside})"
    if resume == "never":
        return f"{held}: continue it with actor.checkpoint.resume=auto, or {fresh}"
    if resume == "auto":
        why = f"{len(skipped)} incomplete, skipped" if skipped else "none saved"
        return f"{held} but no complete checkpoint to resume ({why}): {fresh}"
    return f"{held}, not the one of {resume}: resume into an empty output_dir, or {fresh}"


def roll_back(out: Path, ckpt: Checkpointer, found: Loaded) -> Path | None:
    """Cut the run in `out` back to `found`'s step (see the module docstring). Returns where
    the cut rows, events and checkpoints went; None when nothing came after that step."""
    step, aside = found.step, aside_dir(out, "rolled-back")
    cut = [name for name in (METRICS_FILE, AUDIT_FILE) if cut_jsonl(out / name, step, aside / name)]
    if purge_tensorboard(out / TENSORBOARD_DIR, step, aside / TENSORBOARD_DIR):
        cut.append(f"{TENSORBOARD_DIR}/")
    cut += ckpt.discard_after(step, aside)
    if _within(found.path, ckpt.root):
        ckpt.mark_latest(found.path.name)
    # W&B's history lives on its server: the run's W&B sink rewinds it to `step` when it opens
    # (metrics/sinks.py:WandbSink), even when nothing local came after the step.
    mark_wandb_resume(out, step)
    if not cut:
        return None
    after = ", ".join(cut)
    print(f"asyncrl: resume: rolled the run back to step {step}; moved {after} past it to {aside}")
    return aside


def _row_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def cut_jsonl(path: Path, step: int, cut_to: Path) -> int:
    """Drop the rows of `path` for steps after `step` (and a torn last line, a write cut short
    by a crash), appending them to `cut_to`; the file is replaced atomically. Rows dropped."""
    if not path.exists():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    keep, cut = [], []
    for i, line in enumerate(lines):
        row_step = _row_step(line)
        torn = row_step is None and i == len(lines) - 1 and line.strip()
        (cut if torn or (row_step is not None and row_step > step) else keep).append(line)
    if not cut:
        return 0
    cut_to.parent.mkdir(parents=True, exist_ok=True)
    with cut_to.open("a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in cut))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
    os.replace(tmp, path)
    return len(cut)


def purge_tensorboard(logdir: Path, step: int, cut_to: Path) -> bool:
    """Drop the TensorBoard events of steps after `step`. An event file cannot be cut in place
    (TensorBoard reads every file in the directory), so each file holding such events is
    rewritten: its events up to `step` go into one fresh file, written before the old files
    move into `cut_to`. Whether anything was dropped."""
    files = sorted(logdir.glob("events.out.tfevents.*")) if logdir.is_dir() else []
    if not files:
        return False
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    stale = {}
    for path in files:
        # the fresh file gets its own file_version header; a torn last record is left out
        loaded = LegacyEventFileLoader(str(path)).Load()
        events = [e for e in loaded if e.WhichOneof("what") != "file_version"]
        if any(e.step > step for e in events):
            stale[path] = [e for e in events if e.step <= step]
    if not stale:
        return False
    writer = EventFileWriter(str(logdir))
    for events in stale.values():
        for event in events:
            writer.add_event(event)
    writer.close()
    cut_to.mkdir(parents=True, exist_ok=True)
    for path in stale:
        os.replace(path, cut_to / path.name)
    return True

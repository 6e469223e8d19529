"""Save and resume everything a run needs.

A checkpoint is a directory `output_dir/checkpoints/step_<k>/` holding
- `learner.pt`: model, optimizer, scheduler, version, and the critic's model, optimizer and
  scheduler and the KL-in-reward coefficient when configured (torch tensors; loaded with
  `weights_only=True`, so nothing but tensors and plain containers is unpickled),
- with a sharded learner, `learner/`: each rank's shards of its model and optimizer, every
  rank writing its own (learner.pt keeps the rest and "sharded" in their place): FSDP2's (and
  its frozen reference) by torch.distributed.checkpoint, loading onto any rank count, one
  process included; the Megatron learner's (every rank count, one included) by megatron-core's
  distributed checkpointing (torch_dist), loading onto any TP/PP/DP/CP/VPP layout and rank
  count (its optimizer state under the same `use_distributed_optimizer`; see
  `asyncrl.learner.megatron.dist_ckpt`). With ranks on other nodes `output_dir` must be
  shared (checked when they start); older Megatron checkpoints, whose learner.pt holds the full
  weights and each rank's optimizer state, still load (the optimizer onto their layout only),
- `hf/`: the policy as a Hugging Face model directory (when `hf_model` or `model` is saved),
- `extra.msgpack`: the run state: step, RNG states, data position, the replay queue (its groups
  stored as the wire codec's frames, `group_to_bytes`) and, once, the in-flight ledger
  (`outstanding`: the prompts handed out and not delivered, re-issued first on resume), as
  msgpack with numpy arrays as raw bytes,
- `meta.json`: step, version and which contents were saved (older checkpoints lack it).
A checkpoint is complete or ignored: it is written into `.tmp_step_<k>/`, synced and renamed;
`latest` names the newest one and is replaced after it, so a crash mid-save leaves the previous
checkpoint in force (`async_save`: the same, written by a background thread from a snapshot
taken at the save; the Megatron learner's shards are written at the save itself). `resume: auto` does not trust `latest` alone: it opens the step
directories newest first and takes the first complete one (learner.pt loads; extra.msgpack,
when saved, is present and unpacks), naming the ones it skipped and why.

A checkpoint without the run state resumes the learner only (step from the checkpoint, data
position, queue and RNG afresh) and only when asked: `actor.checkpoint.load_contents` set to a
list without `extra` (e.g. `[model, optimizer]`); otherwise resuming it is refused.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import torch

from asyncrl.config import ConfigError

if TYPE_CHECKING:
    from asyncrl.config.schema import CheckpointConfig

_ND = "__ndarray__"
CHECKPOINT_DIR = "checkpoints"
META_FILE = "meta.json"
EXTRA_FILE = "extra.msgpack"
LEARNER_FILE = "learner.pt"
SHARDED_DIR = "learner"  # a sharded learner's model + optimizer, by torch.distributed.checkpoint
SHARDED = "sharded"  # what learner.pt holds in place of what SHARDED_DIR holds
_STEP_DIR = re.compile(r"step_(\d+)")
# what the loop puts in `extra` (run.py): a run state without one of these cannot be resumed
_EXTRA_KEYS = ("step", "version", "rng", "prompts", "queue")


class ResumeError(ConfigError):
    """The run cannot start as configured: output_dir holds another run, or the checkpoint to
    resume from is incomplete or lacks what resuming needs. One line, saying what to do."""


def _pack(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return {_ND: True, "dtype": arr.dtype.str, "shape": list(arr.shape), "data": arr.tobytes()}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _pack(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_pack(v) for v in obj]
    return obj


def _unpack_hook(obj: dict[str, Any]) -> Any:
    if obj.get(_ND) is True:
        return np.frombuffer(obj["data"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    return obj


def dump_msgpack(obj: Any, path: Path) -> None:
    path.write_bytes(msgpack.packb(_pack(obj), use_bin_type=True))


def load_msgpack(path: Path) -> Any:
    return msgpack.unpackb(
        path.read_bytes(), raw=False, object_hook=_unpack_hook, strict_map_key=False
    )


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy = {"kind": kind, "keys": keys, "pos": pos, "has_gauss": has_gauss, "gauss": gauss}
    _, state, position = random.getstate()
    return {"python": list(state), "python_pos": position, "numpy": numpy,
            "torch": torch.get_rng_state().numpy()}  # fmt: skip


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"], n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(torch.from_numpy(np.asarray(state["torch"], dtype=np.uint8)))


def save_learner_file(state: dict[str, Any], path: Path) -> None:
    """torch.save of the learner state (the one place a checkpoint's tensors are written)."""
    torch.save(state, path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a directory too: that syncs its entries (renames)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file under `root`, and `root`, to disk: the rename that publishes a
    checkpoint must not reach the disk before its contents (a power cut would tear it)."""
    for path in [*root.rglob("*"), root]:
        _fsync(path)


@dataclass
class Loaded:
    """A complete checkpoint, read and checked: resuming applies it to the learner."""

    path: Path
    step: int
    state: dict[str, Any]  # learner.pt
    extra: dict[str, Any] | None  # extra.msgpack; None: the checkpoint holds no run state

    def apply(self, learner: Any, load_contents: set[str]) -> dict[str, Any]:
        """Load what `load_contents` names into `learner` (and the RNGs); returns the run
        state to restore, empty when it is not loaded. The learner state is handed over, not
        kept: it may be the size of the model and its optimizer."""
        state, self.state = self.state, {}
        if "optimizer" not in load_contents:
            drop_optimizer(state)
        learner.load_state_dict(state)
        if "extra" not in load_contents or self.extra is None:
            return {}
        set_rng_state(self.extra["rng"])
        return self.extra


def drop_optimizer(state: dict[str, Any]) -> None:
    """Remove the optimizer and scheduler states from a learner state: the policy's, and its
    critic's (a nested state of its own), in place."""
    for part in (state, state.get("critic")):
        if isinstance(part, dict):
            part.pop("optimizer", None)
            part.pop("scheduler", None)


def load_contents(checkpoint: CheckpointConfig) -> set[str]:
    """What resuming loads: `load_contents` when set, else `save_contents` and the run state
    (`extra`): a resume continues the run, and loads the learner only when told so."""
    if checkpoint.load_contents is not None:
        return set(checkpoint.load_contents)
    return {*checkpoint.save_contents, "extra"}


class IncompleteCheckpoint(ResumeError):
    """A checkpoint directory that cannot be resumed from (torn, missing a file)."""


def _why(exc: BaseException) -> str:
    """The exception in one short line (torch's can run to paragraphs)."""
    first = (str(exc).strip().splitlines() or [""])[0]
    if len(first) > 100:
        first = first.split(". ")[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _read_meta(path: Path) -> dict[str, Any] | None:
    if not (path / META_FILE).exists():
        return None  # saved before meta.json existed
    try:
        meta = json.loads((path / META_FILE).read_text())
        return {"step": int(meta["step"]), "contents": set(meta["contents"])}
    except (ValueError, KeyError, TypeError) as e:
        raise IncompleteCheckpoint(f"{META_FILE} is unreadable ({_why(e)})") from None


def _read_extra(path: Path, version: int | None) -> dict[str, Any]:
    if not (path / EXTRA_FILE).exists():
        raise IncompleteCheckpoint(f"{EXTRA_FILE} is missing")
    try:
        extra = load_msgpack(path / EXTRA_FILE)
    except (ValueError, msgpack.UnpackException) as e:
        raise IncompleteCheckpoint(f"{EXTRA_FILE} does not unpack ({_why(e)})") from None
    missing = [k for k in _EXTRA_KEYS if not isinstance(extra, dict) or k not in extra]
    if missing:
        raise IncompleteCheckpoint(f"{EXTRA_FILE} lacks {', '.join(missing)}")
    if version is not None and int(extra["version"]) != version:
        raise IncompleteCheckpoint(
            f"{LEARNER_FILE} (version {version}) and {EXTRA_FILE} "
            f"(version {extra['version']}) are not from the same save"
        )
    return extra


def _step_of(path: Path, meta: dict[str, Any] | None, extra: dict[str, Any] | None) -> int:
    if extra is not None:
        return int(extra["step"])
    if meta is not None:
        return meta["step"]
    if match := _STEP_DIR.fullmatch(path.name):
        return int(match.group(1))
    raise IncompleteCheckpoint(f"neither {EXTRA_FILE} nor {META_FILE} gives its step")


class CheckpointSaveError(RuntimeError):
    """A (background) checkpoint save failed; the previous checkpoint stays in force."""


class Checkpointer:
    """Writes and finds checkpoints. `async_save`: `save` snapshots everything on the calling
    thread (tensors copied to the CPU, the run state packed) and a background thread writes it;
    one save at a time (a save waits for the previous one), `wait` for the last."""

    def __init__(
        self, output_dir: str | Path, save_contents: list[str], async_save: bool = False
    ) -> None:
        self.root, self.save_contents = Path(output_dir) / CHECKPOINT_DIR, set(save_contents)
        self.async_save, self._writer = async_save, None  # type: threading.Thread | None
        self._error: BaseException | None = None

    def save(self, step: int, learner: Any, extra: dict[str, Any], tokenizer: Any = None) -> Path:
        """Write step `step` atomically (temp dir, synced → rename), then point `latest` at it."""
        self.wait()  # the previous save is complete (or its error raised) before this starts
        final, tmp = self.root / f"step_{step}", self.root / f".tmp_step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write = self._snapshot(tmp, step, learner, extra, tokenizer)
        if not self.async_save:
            write()
            self._publish(tmp, final)
            return final
        self._writer = threading.Thread(
            target=self._background, args=(write, tmp, final), name="asyncrl-ckpt", daemon=True
        )
        self._writer.start()
        return final

    def wait(self) -> None:
        """Wait for a background save; its failure raises here as one CheckpointSaveError."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointSaveError(f"checkpoint save failed: {_why(error)}") from error

    def _background(self, write: Callable[[], None], tmp: Path, final: Path) -> None:
        try:  # a failure leaves the temp dir, never a step dir: the previous checkpoint holds
            write()
            self._publish(tmp, final)
        except BaseException as e:  # noqa: BLE001 - kept for the loop thread (`wait`)
            self._error = e

    def _snapshot(
        self, tmp: Path, step: int, learner: Any, extra: dict[str, Any], tokenizer: Any
    ) -> Callable[[], None]:
        """Take everything the checkpoint holds now; returns the call that writes it to `tmp`.
        Sharded learners write their shards into `tmp/learner/` by DCP, every rank its own."""
        state = learner.state_dict()
        with_optimizer = "optimizer" in self.save_contents
        if not with_optimizer:
            drop_optimizer(state)
        if self.async_save:  # a snapshot later in-place updates cannot change
            from asyncrl.learner.torch.fsdp import stage_to_cpu

            state = stage_to_cpu(state)
        shards = None
        if state.get("model") == SHARDED:
            shards = learner.save_sharded(tmp / SHARDED_DIR, self.async_save, with_optimizer)
        hf = None
        if self.save_contents & {"hf_model", "model"}:
            snapshot = getattr(learner, "pretrained_snapshot", None) if self.async_save else None
            hf = snapshot() if snapshot is not None else None
            if hf is None:  # exported now (a learner that cannot snapshot it, or a sync save)
                learner.save_pretrained(tmp / "hf")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "hf")
        packed = None
        if "extra" in self.save_contents:
            packed = msgpack.packb(_pack({**extra, "step": step, "rng": rng_state()}),
                                   use_bin_type=True)  # fmt: skip
        meta = {"step": step, "version": int(state.get("version", 0))}

        def write() -> None:
            save_learner_file(state, tmp / LEARNER_FILE)
            if hf is not None:
                hf(tmp / "hf")
            if packed is not None:
                (tmp / EXTRA_FILE).write_bytes(packed)
            if shards is not None:
                shards()  # every rank's shards are written
            contents = sorted(self.save_contents)
            (tmp / META_FILE).write_text(json.dumps({**meta, "contents": contents}))

        return write

    def _publish(self, tmp: Path, final: Path) -> None:
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync(self.root)
        self.mark_latest(final.name)

    def mark_latest(self, name: str) -> None:
        """Point `latest` at checkpoint `name` (atomically: a reader sees the old or new name)."""
        (self.root / "latest.tmp").write_text(name)
        os.replace(self.root / "latest.tmp", self.root / "latest")

    def step_dirs(self) -> list[Path]:
        """The checkpoint directories, newest step first (temp dirs of a cut save excluded)."""
        if not self.root.is_dir():
            return []
        found = [
            (int(m.group(1)), p)
            for p in self.root.iterdir()
            if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()
        ]
        return [p for _, p in sorted(found, reverse=True)]

    def find(self, resume: str) -> tuple[Loaded | None, list[str]]:
        """The checkpoint to resume from, read and checked, and why others were skipped.
        `never` → None; `auto` → the newest complete one, or None; else that directory, which
        must be complete (ResumeError otherwise)."""
        if resume == "never":
            return None, []
        if resume != "auto":
            try:
                return self.open(Path(resume)), []
            except IncompleteCheckpoint as e:
                raise ResumeError(f"actor.checkpoint.resume={resume}: {e}") from None
        skipped: list[str] = []
        for path in self.step_dirs():
            try:
                return self.open(path), skipped
            except IncompleteCheckpoint as e:
                skipped.append(f"{path.name}: {e}")
        return None, skipped

    @staticmethod
    def open(path: Path) -> Loaded:
        """Read and check one checkpoint directory; IncompleteCheckpoint says what is wrong."""
        if not (path / LEARNER_FILE).is_file():
            raise IncompleteCheckpoint(f"no {LEARNER_FILE} (not a checkpoint)")
        meta = _read_meta(path)
        try:
            state = torch.load(path / LEARNER_FILE, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever fails to read, the file is unusable
            raise IncompleteCheckpoint(f"{LEARNER_FILE} does not load ({_why(e)})") from None
        if not isinstance(state, dict):
            raise IncompleteCheckpoint(f"{LEARNER_FILE} holds {type(state).__name__}, not a state")
        if state.get("model") == SHARDED:  # DCP writes .metadata last, once every rank wrote
            if not (path / SHARDED_DIR / ".metadata").is_file():
                raise IncompleteCheckpoint(f"{SHARDED_DIR}/ has no .metadata (a torn save)")
            state["sharded_dir"] = str(path / SHARDED_DIR)
        version = int(state["version"]) if "version" in state else None
        # without meta.json (older saves) an absent extra.msgpack means it was not saved
        saved_extra = "extra" in meta["contents"] if meta else (path / EXTRA_FILE).exists()
        extra = _read_extra(path, version) if saved_extra else None
        return Loaded(path, _step_of(path, meta, extra), state, extra)

    def discard_after(self, step: int, aside: Path) -> list[str]:
        """Move the checkpoints of steps after `step` (a future the resume abandons) into
        `aside`, so a later `resume: auto` cannot pick them; their names. The temp dirs of
        saves cut short go too: they were never checkpoints."""
        for tmp in self.root.glob(".tmp_step_*"):
            shutil.rmtree(tmp, ignore_errors=True)
        moved = []
        for path in self.step_dirs():
            if int(path.name.removeprefix("step_")) > step:
                (aside / CHECKPOINT_DIR).mkdir(parents=True, exist_ok=True)
                shutil.move(path, aside / CHECKPOINT_DIR / path.name)
                moved.append(path.name)
        return moved

"""Save and resume everything a run needs.

A checkpoint is a directory `output_dir/checkpoints/step_<k>/` holding
- `learner.pt`: model, optimizer, scheduler, version (torch tensors; loaded with
  `weights_only=True`, so nothing but tensors and plain containers is unpickled),
- `hf/`: the policy as a Hugging Face model directory (when `hf_model` or `model` is saved),
- `extra.msgpack`: step, RNG states, data position, the replay queue (its groups stored as the
  wire codec's frames, `group_to_bytes`) and, once, the in-flight ledger (`outstanding`: the
  prompts handed out and not delivered, re-issued first on resume), as msgpack with numpy
  arrays as raw bytes.
`latest` names the newest complete checkpoint; it is written last, so a crash mid-save leaves
the previous checkpoint in force.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

_ND = "__ndarray__"


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
    return {
        "python": list(random.getstate()[1]),
        "python_pos": random.getstate()[2],
        "numpy": _pack_numpy_rng(),
        "torch": torch.get_rng_state().numpy(),
    }


def _pack_numpy_rng() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"kind": kind, "keys": keys, "pos": pos, "has_gauss": has_gauss, "gauss": gauss}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"], n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(torch.from_numpy(np.asarray(state["torch"], dtype=np.uint8)))


class Checkpointer:
    def __init__(self, output_dir: str | Path, save_contents: list[str]) -> None:
        self.root = Path(output_dir) / "checkpoints"
        self.save_contents = set(save_contents)

    def save(self, step: int, learner: Any, extra: dict[str, Any], tokenizer: Any = None) -> Path:
        """Write step `step` atomically (temp dir → rename), then point `latest` at it."""
        final = self.root / f"step_{step}"
        tmp = self.root / f".tmp_step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        state = learner.state_dict()
        if "optimizer" not in self.save_contents:
            state.pop("optimizer", None)
            state.pop("scheduler", None)
        torch.save(state, tmp / "learner.pt")
        if self.save_contents & {"hf_model", "model"}:
            learner.save_pretrained(tmp / "hf")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "hf")
        if "extra" in self.save_contents:
            dump_msgpack({**extra, "step": step, "rng": rng_state()}, tmp / "extra.msgpack")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        (self.root / "latest.tmp").write_text(final.name)
        os.replace(self.root / "latest.tmp", self.root / "latest")
        return final

    def find(self, resume: str) -> Path | None:
        """`never` → None; `auto` → the latest checkpoint if any; otherwise a directory."""
        if resume == "never":
            return None
        if resume == "auto":
            marker = self.root / "latest"
            return self.root / marker.read_text().strip() if marker.exists() else None
        path = Path(resume)
        if not (path / "learner.pt").exists():
            raise FileNotFoundError(f"resume: {path} is not a checkpoint (no learner.pt)")
        return path

    @staticmethod
    def load(path: Path, learner: Any, load_contents: set[str]) -> dict[str, Any]:
        state = torch.load(path / "learner.pt", map_location="cpu", weights_only=True)
        if "optimizer" not in load_contents:
            state.pop("optimizer", None)
            state.pop("scheduler", None)
        learner.load_state_dict(state)
        extra: dict[str, Any] = {}
        if "extra" in load_contents and (path / "extra.msgpack").exists():
            extra = load_msgpack(path / "extra.msgpack")
            set_rng_state(extra["rng"])
        return extra

"""verl's `actor.profiler` with `tool: torch`: a torch profiler trace of chosen learner steps.

`profile_step` wraps one `learner.step(...)` of the loop; on a chosen step it records CPU (and
CUDA, when there is a device) activity and writes a Chrome trace, `step_<n>.json` in the save
path (output_dir/profile by default), which Perfetto (ui.perfetto.dev) and TensorBoard's
profiler plugin open. Every other step runs untouched (a null context).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from asyncrl.config.schema import ProfilerConfig

log = logging.getLogger(__name__)


def chosen(cfg: ProfilerConfig, step: int) -> bool:
    """Is learner step `step` (1-based, as the metrics' `step`) traced?"""
    return cfg.enable and cfg.tool == "torch" and step in cfg.steps


def trace_dir(cfg: ProfilerConfig, output_dir: str | Path) -> Path:
    """Where the traces go: save_path, else output_dir/profile."""
    return Path(cfg.save_path) if cfg.save_path else Path(output_dir) / "profile"


@contextlib.contextmanager
def profile_step(cfg: ProfilerConfig, output_dir: str | Path, step: int) -> Iterator[None]:
    """Trace the body when `step` is chosen; a plain pass-through otherwise."""
    if not chosen(cfg, step):
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    out = trace_dir(cfg, output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities, record_shapes=True) as prof:
        yield
    path = out / f"step_{step}.json"
    # Written beside, then renamed: a reader never sees half a trace.
    partial = path.with_suffix(".json.partial")
    prof.export_chrome_trace(str(partial))
    partial.replace(path)
    log.info("asyncrl: profiler: learner step %d traced to %s", step, path)

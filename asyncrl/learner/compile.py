"""verl's `actor.use_torch_compile`: compile a model's forward where torch can, else run eager.

`nn.Module.compile()` compiles in place: the module object, its parameters and its state_dict
names stay the same, so weight sync, checkpoints and LoRA see the model they always saw
(`torch.compile(model)` would wrap it and prefix every name with `_orig_mod.`). Compilation is
lazy, so failure shows up only on the first call: the forward is guarded, and the first error
from the compiler turns compilation off for good with one logged reason; the call is then
answered eagerly (same numbers, since the compiled graph never produced any).
"""

from __future__ import annotations

import logging
import shutil
from typing import Any

import torch

log = logging.getLogger(__name__)


def compile_unavailable() -> str | None:
    """Why torch cannot compile on this machine, or None when it can try."""
    try:
        import torch._dynamo as dynamo
    except ImportError as e:  # a torch build without dynamo
        return f"torch._dynamo is unavailable ({e})"
    if not dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python/platform"
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang", "c++", "g++")):
        return "no C/C++ compiler on PATH (inductor builds its CPU kernels with one)"
    return None


def maybe_compile(
    model: torch.nn.Module, enabled: bool, backend: Any = "inductor"
) -> torch.nn.Module:
    """`model`, compiled in place when `enabled` and torch can; the same object either way.
    `backend` is torch.compile's (tests use aot_eager: the same graph capture, no C build)."""
    if not enabled:
        return model
    reason = compile_unavailable()
    if reason is not None:
        log.warning("asyncrl: use_torch_compile: running eager: %s", reason)
        return model
    # dynamic=True: batch widths change every step; one graph with symbolic sizes instead of
    # a recompile per shape.
    model.compile(dynamic=True, backend=backend)
    compiled = model._compiled_call_impl
    model._compiled_call_impl = _Guarded(model, compiled)
    return model


class _Guarded:
    """The compiled call; on its first failure, eager from then on (one logged line)."""

    def __init__(self, model: torch.nn.Module, compiled: Any) -> None:
        self.model, self.compiled = model, compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any compiler failure means: run eager
            if not _from_compiler(e):
                raise
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("asyncrl: use_torch_compile: compile failed, running eager: %s", reason)
            self.model._compiled_call_impl = None
            return self.model._call_impl(*args, **kwargs)


def _from_compiler(error: Exception) -> bool:
    """An error raised by dynamo/inductor (not by the model's own code run eagerly)."""
    module = type(error).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor", "torch.fx")) or isinstance(
        error, torch._dynamo.exc.TorchDynamoException
    )

"""The megatron-core releases the Megatron learner runs on, and the API differences between them.

`MIN_VERSION`..`MAX_VERSION` is the range the tests have run (the CPU emulation,
tests/test_megatron_cpu_emulation.py, and tests/megatron_py312.sh for the releases that only
publish Python 3.12 wheels); pyproject.toml's `megatron` extra declares the same range
(tests/test_megatron_versions.py keeps the two equal). Which release `pip install
'asyncrl[megatron]'` gets depends on the Python: 0.17 and later publish cp312 wheels only, so
Python 3.11 resolves 0.16.1 and Python 3.12 the newest.

API differences handled here (imported lazily, like every Megatron import of the learner):
- `megatron.core.utils.get_batch_on_this_cp_rank`: 0.15 takes the batch only, 0.16-0.17 an
  optional `cp_group`, 0.18+ a required `is_hybrid_cp` and a `cp_group` it no longer looks up
  itself (without it, it would split over the whole default group).
- `megatron.core.transformer.moe.moe_utils.te_general_gemm`: the MoE router's gating linear
  tests it against None, but releases that lack Transformer Engine never define it (0.16.1:
  a NameError on the first routed token); `router_gemm_fallback` defines it as None, so the
  router takes its own torch.mm path.
"""

from __future__ import annotations

import inspect
import logging
from importlib import metadata
from typing import Any

import torch
from packaging.version import Version

#: The oldest and newest megatron-core the tests ran; the `megatron` extra's bounds.
MIN_VERSION = (0, 15, 0)
MAX_VERSION = (0, 19, 2)

log = logging.getLogger(__name__)


class MegatronVersionError(ImportError):
    """An installed megatron-core older than the learner's API needs."""


def parse_version(text: str) -> tuple[int, ...]:
    """ "0.19.2" -> (0, 19, 2); pre-release and local tails ("0.16.0rc1", "+cu12") dropped."""
    return Version(text).release[:3]


def installed_version() -> str:
    return metadata.version("megatron-core")


def check_version(version: str | None = None) -> str | None:
    """Refuse a megatron-core older than `MIN_VERSION`; warn (one line, returned too) for one
    newer than `MAX_VERSION`, which no test has run."""
    version = version or installed_version()
    found = parse_version(version)
    low, high = ".".join(map(str, MIN_VERSION)), ".".join(map(str, MAX_VERSION))
    if found < MIN_VERSION:
        raise MegatronVersionError(
            f"megatron-core {version} is older than the Megatron learner needs (>= {low}; "
            f"tested {low}..{high}): pip install 'asyncrl[megatron]'"
        )
    if found > MAX_VERSION:
        message = (f"megatron-core {version} is newer than the releases the Megatron learner "
                   f"was tested with ({low}..{high}); if it fails, pin megatron-core<={high}")  # fmt: skip
        log.warning(message)
        return message
    return None


def split_for_cp_rank(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This CP rank's positions of every [B, S] tensor of `batch` (Megatron's load-balanced
    2·CP split, through Megatron's own function whatever its signature)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    params = inspect.signature(get_batch_on_this_cp_rank).parameters
    kwargs: dict[str, Any] = {}
    if "cp_group" in params:
        kwargs["cp_group"] = ps.get_context_parallel_group()
    if "is_hybrid_cp" in params:
        kwargs["is_hybrid_cp"] = False
    return get_batch_on_this_cp_rank(dict(batch), **kwargs)


def router_gemm_fallback() -> None:
    """Without Transformer Engine, let the MoE router's gating linear run its torch path (see
    the module docstring); a release that defines the name is left alone."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

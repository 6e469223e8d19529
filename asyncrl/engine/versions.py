"""Which SGLang releases asyncrl drives, and how each one wants its weight sync done.

Read from SGLang's own source (every wheel 0.5.6 ... 0.5.23) and run: tests/test_sglang_contract.py
executes the request structs, sampling parameters and server-argument parser of each
`CONTRACT_VERSIONS` release on what asyncrl sends and launches with.

- `update_weights_from_distributed` outside `/begin_weight_update` ... `/end_weight_update`
  answers `success: false` from 0.5.21 on (scheduler `weight_updater._session is None`; no
  such session before), and the learner's broadcast would then wait for its timeout: `session`.
- 0.5.6's tokenizer manager returns early while paused, before it records `weight_version`, so
  the version must be set by `/update_weight_version` afterwards (from 0.5.7 on it records it
  paused or not): `explicit_version`.
- A cache flush succeeds only when the scheduler is idle. In `in_place` mode the paused
  requests keep their KV, so a flush never succeeds while they wait (0.5.6-0.5.22 then die on
  `assert flush_cache_success`, 0.5.23 fails the update): asyncrl never flushes in `in_place`
  and relies on the per-version cache namespace (`extra_key`) instead. With `abort` the engine
  empties; with `retract` the requests move to the waiting queue, which the idle check of
  0.5.10-0.5.20 counts (`is_fully_idle`: the flush never succeeds while paused), and that of
  0.5.6-0.5.9 (`_is_no_request`) and >= 0.5.21 (`is_fully_idle(ignore_waiting=paused)`) does
  not: `flush_modes`.
- 0.5.23 reports per-token version spans (`meta_info["weight_versions"]`).
- Every request carries a `sampling_seed`, which SGLang honours only when the server runs
  with `--enable-deterministic-inference` (0.5.6 and 0.5.23 alike: `SamplingBatchInfo` builds
  the seed tensor only then); `check_server_info` refuses an engine whose server info reports
  the flag off.

`hf` is asyncrl's own server (`engine/hf`): the newest protocol, minus the session, plus
requests pinned to a weight version (`PIN_KEY`), which it keeps serving from a copy of those
weights across updates (`pinned_versions`, from its /server_info) and for a lease after the
last one (`pinned_linger_s`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The SGLang releases whose own code the contract tests run on asyncrl's requests and launch
#: lines, one on each side of every change asyncrl depends on: `--default-priority-value`
#: (from 0.5.10), a batch's `extra_key` split per request (`_normalize_extra_key`, from 0.5.14;
#: before, every request of a batch gets the whole list and the radix cache cannot hash it),
#: the weight-update session (from 0.5.21). The supported range is exactly theirs.
CONTRACT_VERSIONS = ("0.5.6", "0.5.10", "0.5.13", "0.5.14", "0.5.21", "0.5.23")
#: The supported range, as in pyproject.toml's `sglang` extra: the lowest and highest run.
MIN_VERSION = tuple(int(x) for x in CONTRACT_VERSIONS[0].split("."))
MAX_VERSION = tuple(int(x) for x in CONTRACT_VERSIONS[-1].split("."))
#: What asyncrl's hf server reports as its `version` in /server_info.
HF_SERVER_VERSION = "asyncrl-hf"
#: The /generate field of asyncrl's hf server (SGLang has none) that pins a request to a weight
#: version: only those weights serve it, kept across updates (`engine/hf/engine.py`).
PIN_KEY = "pin_weight_version"


class UnsupportedEngineError(RuntimeError):
    """An engine whose reported version asyncrl has no weight-sync protocol for."""


@dataclass(frozen=True)
class EngineProfile:
    """The weight-sync steps one engine version needs (see the module docstring)."""

    version: str
    """As the engine reported it (`/server_info` -> `version`)."""
    session: bool = False
    """Buckets must be sent between /begin_weight_update and /end_weight_update."""
    explicit_version: bool = False
    """The version on the last bucket is lost while paused: set it with /update_weight_version."""
    flush_modes: tuple[str, ...] = ("abort", "retract")
    """Pause modes after which a cache flush can succeed (once the engine is idle)."""
    pinned_versions: int = 0
    """Weight versions besides the live one the engine keeps serving `PIN_KEY` requests from
    (0: none, SGLang; a pinned request must finish before its version is replaced)."""
    pinned_linger_s: float = 0.0
    """How long a version stays kept after its last pinned request (0: only while one is
    queued or running): what lets an episode's turns, one after another, stay pinned."""


def parse_version(text: str) -> tuple[int, int, int]:
    """`0.5.6`, `0.5.15.post1`, `0.5.23rc0` -> (major, minor, patch)."""
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", str(text).strip())
    if not m:
        raise UnsupportedEngineError(f"engine reports version {text!r}, not MAJOR.MINOR.PATCH")
    return int(m[1]), int(m[2]), int(m[3])


def seed_warning(info: Mapping[str, Any], url: str) -> str | None:
    """What to tell the user about an SGLang engine that ignores the per-request
    `sampling_seed` asyncrl sends (SGLang builds its seed tensor only under
    `--enable-deterministic-inference`, 0.5.6 and 0.5.23 read): sampling still works, but is
    not reproducible. Not a refusal: deterministic inference trades throughput (batch-invariant
    kernels) and is the user's choice. A server that does not report the flag (asyncrl's hf
    server, which always honours the seed) gets none."""
    if info.get("enable_deterministic_inference") is not False:
        return None
    return (
        f"SGLang at {url} runs without --enable-deterministic-inference: it ignores the "
        "per-request sampling_seed, so sampling is not reproducible (set actor_infer."
        "strategy_args.strategy_config.enable_deterministic_inference: true for that, at "
        "some throughput cost)"
    )


def profile_for(version: str, info: Mapping[str, Any] | None = None) -> EngineProfile:
    """The profile of an engine reporting `version` (and the rest of its server `info`);
    UnsupportedEngineError outside the range."""
    if version == HF_SERVER_VERSION:
        kept = (info or {}).get("max_pinned_versions", 0)
        ok = isinstance(kept, int) and not isinstance(kept, bool) and kept >= 0
        linger = (info or {}).get("pinned_version_linger_s", 0.0)
        finite = isinstance(linger, int | float) and not isinstance(linger, bool)
        linger = float(linger) if finite and 0 <= linger < float("inf") else 0.0
        return EngineProfile(version, pinned_versions=kept if ok else 0, pinned_linger_s=linger)
    v = parse_version(version)
    if not MIN_VERSION <= v <= MAX_VERSION:
        lo, hi = (".".join(map(str, x)) for x in (MIN_VERSION, MAX_VERSION))
        raise UnsupportedEngineError(
            f"SGLang {version} is outside the supported range {lo}..{hi} "
            "(pip install 'asyncrl[sglang]' picks one inside it)"
        )
    # read in every wheel 0.5.6-0.5.23 (the module docstring)
    retract_flush = v < (0, 5, 10) or v >= (0, 5, 21)
    return EngineProfile(
        version,
        session=v >= (0, 5, 21),
        explicit_version=v < (0, 5, 7),
        flush_modes=("abort", "retract") if retract_flush else ("abort",),
    )

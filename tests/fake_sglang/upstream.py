"""What the fake SGLang does differently per release, as read in SGLang's own source.

The release is `FAKE_SGLANG_VERSION` (default: the highest asyncrl supports). Each flag below
names the upstream code it models, so a regression test fails on an asyncrl code path that
real SGLang would fail on:

- `session` (>= 0.5.21): `update_weights_from_distributed` outside `/begin_weight_update` ...
  `/end_weight_update` answers `success: false` and never joins the broadcast
  (`scheduler_components/weight_updater.py`).
- `drops_paused_version` (0.5.6; 0.5.7 records it paused or not): the tokenizer manager returns early while paused, before it
  records `weight_version` (`tokenizer_communicator_mixin.update_weights_from_distributed`).
- `dies_on_refused_flush` (< 0.5.23): `flush_cache=True` on an update while the scheduler is
  not idle hits `assert flush_cache_success` and the server dies; 0.5.23 answers
  `success: false` instead.
- `counts_waiting` (0.5.10 .. 0.5.20): the idle check behind a flush (`is_fully_idle`) counts
  the waiting queue, where `retract` puts the paused requests (0.5.6-0.5.9's `_is_no_request`
  does not look at it; >= 0.5.21 ignores it while paused).
- `version_spans` (>= 0.5.23): `meta_info["weight_versions"]`, per-token version spans.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

DEFAULT_VERSION = "0.5.23"


@dataclass(frozen=True)
class Upstream:
    version: str
    session: bool
    drops_paused_version: bool
    dies_on_refused_flush: bool
    counts_waiting: bool
    version_spans: bool
    routed_experts: bool  # --enable-return-routed-experts and meta_info["routed_experts"]
    token_delay_s: float

    @classmethod
    def from_env(cls) -> Upstream:
        version = os.environ.get("FAKE_SGLANG_VERSION", DEFAULT_VERSION)
        m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
        if not m:
            raise SystemExit(f"FAKE_SGLANG_VERSION={version!r} is not MAJOR.MINOR.PATCH")
        v = tuple(int(x) for x in m.groups())
        return cls(
            version=version,
            session=v >= (0, 5, 21),
            drops_paused_version=v < (0, 5, 7),
            dies_on_refused_flush=v < (0, 5, 23),
            counts_waiting=(0, 5, 10) <= v < (0, 5, 21),
            version_spans=v >= (0, 5, 23),
            routed_experts=v >= (0, 5, 10),
            # per generated token: lets a test catch requests in flight (the fake's own pace)
            token_delay_s=float(os.environ.get("FAKE_SGLANG_TOKEN_DELAY_S", "0")),
        )


def version_spans(versions: list[str]) -> list[dict]:
    """SGLang 0.5.23's `weight_versions`: contiguous spans of equal versions."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans

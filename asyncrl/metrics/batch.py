"""Metrics of one trained batch: staleness, rewards, lengths, throughput, learner idle time,
and the environment episodes' counts; plus the audit trail of every trained group id.

`BatchMetrics` keeps the clock between steps (throughput is tokens per wall-clock second of
the whole step, waiting included). `TrainedGroupLog` appends one JSON line per step to
`trained_groups.jsonl`: the evidence that no group was lost or trained on twice.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from asyncrl.metrics.collapse import length_metrics
from asyncrl.metrics.episodes import episode_metrics
from asyncrl.types import TrajectoryGroup

AUDIT_FILE = "trained_groups.jsonl"


class BatchMetrics:
    def __init__(self) -> None:
        self._last_step_time = time.perf_counter()

    def __call__(
        self, groups: Sequence[TrajectoryGroup], version: int, idle: float
    ) -> dict[str, float]:
        """`version`: the learner's version after training on `groups`; `idle`: seconds the
        learner waited for them."""
        now = time.perf_counter()
        elapsed, self._last_step_time = now - self._last_step_time, now
        lags = [version - 1 - g.min_version() for g in groups]  # staleness when trained on
        tokens = sum(g.num_tokens for g in groups)
        rewards = np.concatenate([g.rewards for g in groups])
        out = {
            "version": float(version),
            "rollout/policy_version_min": float(min(g.min_version() for g in groups)),
            "rollout/policy_version_max": float(max(g.max_version() for g in groups)),
            "rollout/reward_mean": float(rewards.mean()),
            "rollout/response_length_mean": tokens / max(1, sum(g.n for g in groups)),
            "replay/staleness_mean": float(np.mean(lags)),
            "replay/staleness_max": float(max(lags)),
            "throughput/tokens_per_s": tokens / max(elapsed, 1e-9),
            "learner/idle_frac": idle / max(elapsed, 1e-9),
            "learner/wait_seconds": idle,
        }
        for lag, count in Counter(lags).items():
            out[f"replay/staleness_hist/{lag}"] = float(count)
        out.update(episode_metrics(groups))
        out.update(length_metrics(groups))  # p10/p50/p90: a collapse to one length shows
        return out


class TrainedGroupLog:
    """Append-only `trained_groups.jsonl` in `output_dir`: {"step": k, "ids": [...]} per step."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / AUDIT_FILE

    def append(self, step: int, groups: Sequence[TrajectoryGroup]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "ids": [g.group_id for g in groups]}) + "\n")

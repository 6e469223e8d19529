"""Replay: the staleness-bounded queue between rollout actors and the learner (pure Python)."""

from asyncrl.replay.filters import (
    FILTER_FACTORIES,
    GroupFilter,
    build_filters,
    dapo_zero_variance,
    filter_name,
    length_filter,
)
from asyncrl.replay.queue import (
    DuplicateGroupError,
    ReplayConfig,
    ReplayError,
    ReplayQueue,
    staleness,
)

__all__ = [
    "FILTER_FACTORIES",
    "DuplicateGroupError",
    "GroupFilter",
    "ReplayConfig",
    "ReplayError",
    "ReplayQueue",
    "build_filters",
    "dapo_zero_variance",
    "filter_name",
    "length_filter",
    "staleness",
]

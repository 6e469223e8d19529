"""Replay: admission (the staleness capacity rule and the run's in-flight ledger) and the group
buffer, behind the `ReplayQueue` the loop uses (pure Python and numpy)."""

from asyncrl.replay.admission import Admission, InFlightLedger, ReplayError
from asyncrl.replay.buffer import DuplicateGroupError, GroupBuffer, staleness
from asyncrl.replay.filters import (
    FILTER_FACTORIES,
    GroupFilter,
    build_filters,
    dapo_zero_variance,
    filter_name,
    length_filter,
)
from asyncrl.replay.queue import ReplayConfig, ReplayQueue

__all__ = [
    "FILTER_FACTORIES",
    "Admission",
    "DuplicateGroupError",
    "GroupBuffer",
    "GroupFilter",
    "InFlightLedger",
    "ReplayConfig",
    "ReplayError",
    "ReplayQueue",
    "build_filters",
    "dapo_zero_variance",
    "filter_name",
    "length_filter",
    "staleness",
]

"""Replay: admission (the staleness capacity rule, the token budget and the run's in-flight
ledger), the group buffer and the adaptive staleness bound's controller, behind the
`ReplayQueue` the loop uses (pure Python and numpy)."""

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
from asyncrl.replay.staleness_control import ControlSettings, Decision, StalenessController
from asyncrl.replay.tokens import TokenBudget, group_tokens

__all__ = [
    "FILTER_FACTORIES",
    "Admission",
    "ControlSettings",
    "Decision",
    "DuplicateGroupError",
    "GroupBuffer",
    "GroupFilter",
    "InFlightLedger",
    "ReplayConfig",
    "ReplayError",
    "ReplayQueue",
    "StalenessController",
    "TokenBudget",
    "build_filters",
    "dapo_zero_variance",
    "filter_name",
    "group_tokens",
    "length_filter",
    "staleness",
]

"""Typed configuration: schema (dataclasses), loader (YAML + overrides), validation, plan."""

from asyncrl.config.loader import apply_override, load_config, to_dict
from asyncrl.config.plan import BatchPlan, derive_plan
from asyncrl.config.schema import Config, ConfigError

__all__ = [
    "BatchPlan",
    "Config",
    "ConfigError",
    "apply_override",
    "derive_plan",
    "load_config",
    "to_dict",
]

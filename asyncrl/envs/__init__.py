"""Agentic environments: the `Env` protocol, the registry, one module per built-in, tools."""

from asyncrl.envs.base import Env, EnvError, Message, Observation, as_messages
from asyncrl.envs.registry import BUILTIN_ENVS, env_names, make_env, resolve_env

__all__ = [
    "BUILTIN_ENVS",
    "Env",
    "EnvError",
    "Message",
    "Observation",
    "as_messages",
    "env_names",
    "make_env",
    "resolve_env",
]

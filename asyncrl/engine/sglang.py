"""SGLang rollout servers: config -> command lines, the launcher, and the router (their processes
and health: `sglang_process.py`).

One engine = one `python -m sglang.launch_server` process with tensor-parallel size
`actor_infer.num_gpus_per_worker`, seeing exactly its slice of `actor_infer.device_mapping`
(through CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES). With several engines the
sglang-router (`python -m sglang_router.launch_router --worker-urls ... --policy ...`) stands in
front of them for generation; control calls (pause, weight updates, flush) still go to each
worker directly. With `strategy_config.server_urls` nothing is launched: the given servers are
attached to (and must run with tp size `num_gpus_per_worker`).

`strategy_config` keys, by rule:
- asyncrl's own (never passed to SGLang): `server_urls`, `router` (true | false | auto — auto:
  when there is more than one engine), `router_policy` (default cache_aware), `router_args`
  (a mapping, rendered like server flags), `launch_timeout_s` (default 900), `host` (default
  `cluster.bind_host`, 127.0.0.1; a wildcard bind is reached at the node's address), `env`
  (extra environment variables for the server processes), `api_key` (the engines' key, e.g.
  the one attached `server_urls` were started with; default: the run's own per-run secret,
  see below).
- set by asyncrl and refused in strategy_config: `model_path`, `port`, `tp_size` (and its
  aliases `tp`, `tensor_parallel_size`; use num_gpus_per_worker).
- renamed: `max_model_len` -> `--context-length` (ROLL's key for SGLang's flag).
- every other key is passed through as a flag: `snake_case` -> `--kebab-case`; `true` -> the
  bare flag (SGLang's booleans are set-to-enable), `false`/`null` -> omitted; a list -> the flag
  followed by each item; a mapping -> the flag followed by its JSON; anything else -> str(value).
  So `mem_fraction_static: 0.7` -> `--mem-fraction-static 0.7`, `load_format: dummy` ->
  `--load-format dummy`. `dtype` defaults from `actor_infer.model_args.dtype`.

Authentication: with an API key, every server gets `--api-key KEY` (SGLang then wants
`Authorization: Bearer KEY` on all but /health*), and the router gets `--api-key KEY` too
(SGLang's router uses it to call its workers; it does not check its own callers, and listens on
`host`, loopback by default). SGLang reads the key only from its command line, so it is visible
in `ps` to users of the same machine (asyncrl's own hf server takes it from the environment).

Priority: evaluation requests carry SGLang's `priority` (`logging.eval_priority`), rollout
requests none. SGLang ignores `priority` unless started with `--enable-priority-scheduling`
(then a larger value goes first), and a request without one gets the lowest priority there
unless `--default-priority-value` says otherwise; so when the evaluation priority differs from
rollout's (0), launched servers get `--enable-priority-scheduling --default-priority-value 0`
(`with_priority`). That needs `schedule_policy` fcfs or lof (SGLang asserts it) and a release
with `--default-priority-value` (from 0.5.10; SGLang's own parser of each release is run on
these lines by tests/test_sglang_contract.py): otherwise one line refuses it.

LoRA (`weight_sync.lora_sync: native`): launched servers get `--enable-lora --max-lora-rank R
--lora-target-modules M...` (`with_lora`: R the adapter's rank, M `all` for peft's all-linear
or the listed modules; strategy_config keys of the same names win). Attached servers must have
been started so; a refused adapter load then names what is missing.

Launched processes die with the driver, SIGKILL included (`engine/process.py`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from asyncrl.config.schema import WorkerConfig
from asyncrl.device import DeviceSpec
from asyncrl.engine.process import ServerHandle
from asyncrl.engine.sglang_process import attach, start_process, wait_healthy
from asyncrl.engine.versions import parse_version
from asyncrl.net import advertised_host, free_port, url_host

OWN_KEYS = ("server_urls", "router", "router_policy", "router_args", "launch_timeout_s", "host")
OWN_KEYS += ("env", "api_key")
RESERVED = ("model_path", "port", "tp_size", "tp", "tensor_parallel_size")
RENAMED = {"max_model_len": "context_length"}
#: Parallelism SGLang's distributed weight update cannot serve: it asserts dp_size == 1, and the
#: update group places engine ranks at rank_offset + tp_rank only (no pipeline stages).
SINGLE_ONLY = {
    "dp_size": "dp_size", "dp": "dp_size", "data_parallel_size": "dp_size",
    "pp_size": "pp_size", "pp": "pp_size", "pipeline_parallel_size": "pp_size",
}  # fmt: skip
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: The server flag of routed experts (`actor.router_replay: r3`). sglang-router (0.3.2, the
#: newest) forwards /generate as its own typed struct, which lacks `return_routed_experts`:
#: the field never reaches a worker (tests/test_router_e2e.py), so with this flag rollout
#: workers reach the engines directly (`router: auto`), and `router: true` is refused.
ROUTES_FLAG = "enable_return_routed_experts"
#: Rollout requests carry no priority; the servers' default for them when priority is on.
ROLLOUT_PRIORITY = 0
#: The first release with `--default-priority-value` (0.5.9's server_args lacks it).
PRIORITY_DEFAULT_VERSION = (0, 5, 10)


@dataclass(frozen=True)
class LoraServing:
    """What the engines must serve for `lora_sync: native`: the adapter's rank and targets."""

    rank: int
    target_modules: str | list[str]  # peft's: "all-linear" or module names


def with_lora(settings: SGLangSettings, lora: LoraServing | None) -> SGLangSettings:
    """`settings` with SGLang's LoRA flags for `lora` (unchanged without; attached servers
    keep the flags they were started with)."""
    if lora is None or settings.server_urls:
        return settings
    targets = lora.target_modules
    flags = dict(settings.server_flags)
    flags.setdefault("enable_lora", True)
    flags.setdefault("max_lora_rank", lora.rank)
    flags.setdefault("lora_target_modules", ["all"] if targets == "all-linear" else list(targets))
    return replace(settings, server_flags=flags)


class SGLangConfigError(ValueError):
    """A strategy_config for the sglang backend that cannot be turned into a launch."""


@dataclass(frozen=True)
class SGLangSettings:
    """asyncrl's own keys of `actor_infer.strategy_args.strategy_config`, parsed."""

    server_flags: dict[str, Any]
    server_urls: list[str] = field(default_factory=list)
    router: bool | str = "auto"
    router_policy: str = "cache_aware"
    router_args: dict[str, Any] = field(default_factory=dict)
    launch_timeout_s: float = 900.0
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None

    @classmethod
    def parse(cls, strategy_config: Mapping[str, Any], dtype: str | None = None) -> SGLangSettings:
        own = {k: v for k, v in strategy_config.items() if k in OWN_KEYS}
        flags = {RENAMED.get(k, k): v for k, v in strategy_config.items() if k not in OWN_KEYS}
        bad = sorted(k for k in flags if k in RESERVED)
        if bad:
            raise SGLangConfigError(
                f"actor_infer.strategy_args.strategy_config.{bad[0]} is set by asyncrl "
                "(tensor-parallel size comes from actor_infer.num_gpus_per_worker)"
            )
        for key in sorted(k for k in flags if k in SINGLE_ONLY):
            if flags[key] not in (None, 1):
                raise SGLangConfigError(
                    f"actor_infer.strategy_args.strategy_config.{key}={flags[key]!r}: SGLang's "
                    f"weight update from the learner needs {SINGLE_ONLY[key]} 1 (use more engines "
                    "for more replicas)"
                )
        if dtype and "dtype" not in flags:
            flags["dtype"] = DTYPES.get(dtype, dtype)
        urls = own.get("server_urls") or []
        if isinstance(urls, str) or not all(isinstance(u, str) for u in urls):
            raise SGLangConfigError("strategy_config.server_urls must be a list of URLs")
        if own.get("router", "auto") not in (True, False, "auto"):
            raise SGLangConfigError("strategy_config.router must be true, false or auto")
        return cls(
            server_flags=flags,
            server_urls=[u.rstrip("/") for u in urls],
            router=own.get("router", "auto"),
            router_policy=str(own.get("router_policy", "cache_aware")),
            router_args=checked_router_args(own.get("router_args")),
            launch_timeout_s=float(own.get("launch_timeout_s", 900.0)),
            host=str(own.get("host", "127.0.0.1")),
            env={str(k): str(v) for k, v in (own.get("env") or {}).items()},
            api_key=str(own["api_key"]) if own.get("api_key") else None,
        )


def to_flags(options: Mapping[str, Any]) -> list[str]:
    """Render `{key: value}` as command-line flags by the rule in the module docstring."""
    out: list[str] = []
    for key, value in options.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list | tuple):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, Mapping):
            out += [flag, json.dumps(value, sort_keys=True)]
        else:
            out += [flag, str(value)]
    return out


def server_command(
    model_path: str | os.PathLike,
    port: int,
    tp_size: int,
    settings: SGLangSettings,
    seed: int | None = None,
    *,
    api_key: str | None = None,
) -> list[str]:
    """`python -m sglang.launch_server ...` for one engine (`--api-key` last, when given)."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path)]
    cmd += ["--host", settings.host, "--port", str(port), "--tp-size", str(tp_size)]
    flags = dict(settings.server_flags)
    if seed is not None and "random_seed" not in flags:
        flags["random_seed"] = seed
    return cmd + to_flags(flags) + (["--api-key", api_key] if api_key else [])


def with_priority(
    settings: SGLangSettings, eval_priority: int | None, installed: str | None
) -> SGLangSettings:
    """`settings` with SGLang's priority scheduling on when evaluation runs at another priority
    than rollout (`installed`: the local sglang version, None when unknown)."""
    if eval_priority in (None, ROLLOUT_PRIORITY) or settings.server_urls:
        return settings  # attached servers keep the flags they were started with
    what = f"logging.eval_priority={eval_priority} needs SGLang's priority scheduling, but"
    policy = settings.server_flags.get("schedule_policy", "fcfs")
    if policy not in ("fcfs", "lof"):
        raise SGLangConfigError(
            f"{what} schedule_policy {policy!r} refuses it (fcfs or lof; or eval_priority=0)"
        )
    if installed is not None and parse_version(installed) < PRIORITY_DEFAULT_VERSION:
        raise SGLangConfigError(
            f"{what} SGLang {installed} has no --default-priority-value (rollout requests would "
            "rank last): set logging.eval_priority=0 or use SGLang >= "
            + ".".join(map(str, PRIORITY_DEFAULT_VERSION))
        )
    flags = dict(settings.server_flags)
    flags.setdefault("enable_priority_scheduling", True)
    flags.setdefault("default_priority_value", ROLLOUT_PRIORITY)
    return replace(settings, server_flags=flags)


def installed_sglang() -> str | None:
    """The version of the sglang package the servers are launched from, None if absent."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def router_command(
    worker_urls: Sequence[str], port: int, settings: SGLangSettings, api_key: str | None = None
) -> list[str]:
    """`python -m sglang_router.launch_router --worker-urls ... --policy ...`.

    Its Prometheus exporter binds loopback on a free port unless `router_args` say otherwise
    (also when the router itself binds every interface, multi-node: the metrics are this
    host's business): sglang-router's default, 0.0.0.0:29000, exposes the metrics and makes a
    second router on the host fail to start.

    The router's own worker health checks are off unless `router_args` sets
    `disable_health_check: false`: they GET the workers' `/health`, which in SGLang (0.5.6 to
    0.5.23, `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` on by default) generates a token, so a
    paused engine answers 503 after `SGLANG_HEALTH_CHECK_TIMEOUT` (20 s) -- later than the
    router's 5 s check timeout -- and a weight sync longer than its failure window (3 checks,
    60 s apart) drops every paused worker: requests then get 503 "no available workers" until
    2 more checks pass. Without them the router keeps every worker for a sync of any length
    (requests wait in the paused engine, as sent to it directly); a dead worker's requests
    are retried on another (the router's retries and circuit breaker), and the fleet's own
    health checks relaunch it on its port (`engine/health.py`)."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls]
    cmd += ["--policy", settings.router_policy, "--host", settings.host, "--port", str(port)]
    args = {"disable_health_check": True, **settings.router_args}
    args.setdefault("prometheus_host", "127.0.0.1")
    if "prometheus_port" not in args:
        args["prometheus_port"] = free_port(str(args["prometheus_host"]))
    return cmd + to_flags(args) + (["--api-key", api_key] if api_key else [])


def checked_router_args(args: Mapping[str, Any] | None) -> dict[str, Any]:
    """`router_args`, refused where they tune the router's worker health checks while those
    are off (`router_command`): they would do nothing."""
    out = dict(args or {})
    tuned = sorted(str(k) for k in out if str(k).startswith("health_"))
    if tuned and out.get("disable_health_check", True) is not False:
        raise SGLangConfigError(
            f"strategy_config.router_args.{tuned[0]} tunes the router's worker health checks, "
            "which asyncrl turns off (a paused SGLang engine fails them, and the router drops "
            "it during a weight sync); set router_args.disable_health_check: false to use them"
        )
    return out


def engine_devices(device_mapping: Sequence[int], tp_size: int) -> list[list[int]]:
    """Split `device_mapping` into one slice of `tp_size` devices per engine."""
    if not device_mapping:
        return [[]]
    if len(device_mapping) % tp_size:
        raise SGLangConfigError(
            f"actor_infer.device_mapping has {len(device_mapping)} devices, not a multiple of "
            f"num_gpus_per_worker={tp_size}"
        )
    return [list(device_mapping[i : i + tp_size]) for i in range(0, len(device_mapping), tp_size)]


# ---- the launcher EngineFleet uses ------------------------------------------------------------
class SGLangLauncher:
    """Launches (or attaches to) the SGLang engines of `actor_infer`, and the router."""

    def __init__(
        self,
        infer: WorkerConfig,
        model_dir: Path,
        log_dir: Path,
        seed: int,
        device: DeviceSpec,
        api_key: str | None = None,
        eval_priority: int | None = None,
        host: str = "127.0.0.1",
        lora: LoraServing | None = None,
    ) -> None:
        settings = SGLangSettings.parse(infer.strategy_args.strategy_config, infer.model_args.dtype)
        if "host" not in infer.strategy_args.strategy_config:  # cluster.bind_host
            settings = replace(settings, host=host)
        settings = with_lora(settings, lora)
        self.settings = with_priority(settings, eval_priority, installed_sglang())
        # Attached servers keep the key they were started with; launched ones get the run's.
        self.api_key = self.settings.api_key or api_key
        self.model_dir, self.log_dir, self.seed, self.device = model_dir, log_dir, seed, device
        self.tp_size = infer.num_gpus_per_worker
        if self.settings.server_urls:
            self.devices: list[list[int]] = [[] for _ in self.settings.server_urls]
        else:
            self.devices = engine_devices(infer.device_mapping, self.tp_size)
        self.num_engines = len(self.devices)
        self.router: ServerHandle | None = None
        self._router_lock = threading.Lock()  # workers ask for URLs from several threads

    def launch(self, index: int, port: int | None = None) -> ServerHandle:
        timeout = self.settings.launch_timeout_s
        if self.settings.server_urls:
            return attach(self.settings.server_urls[index], timeout, self.tp_size, self.api_key)
        port = port or free_port(self.settings.host)
        cmd = server_command(
            self.model_dir, port, self.tp_size, self.settings, self.seed + index,
            api_key=self.api_key,
        )  # fmt: skip
        env = {**self.device.visibility(self.devices[index]), **self.settings.env}
        url = f"http://{url_host(advertised_host(self.settings.host))}:{port}"
        handle = start_process(cmd, env, url, self.log_dir / f"sglang_{index}_{port}.log")
        return wait_healthy(handle, "/health_generate", timeout, f"sglang engine {index}")

    def actor_urls(self, worker_urls: list[str]) -> list[str]:
        """Where rollout workers send /generate: the router when there is one, else the workers."""
        if not self.routes(len(worker_urls)):
            return list(worker_urls)
        with self._router_lock:
            if self.router is None or self.router.proc.poll() is not None:
                self.router = self._start_router(worker_urls)
            return [self.router.url]

    def routes(self, engines: int) -> bool:
        """Whether rollout workers reach `engines` engines through the router (`router`: true,
        or auto with more than one)."""
        wanted = self.settings.router
        if wanted == "auto" and self.settings.server_flags.get(ROUTES_FLAG):
            return False  # the router drops return_routed_experts (ROUTES_FLAG's comment)
        return wanted is True or (wanted == "auto" and engines >= 2)

    def _start_router(self, worker_urls: list[str]) -> ServerHandle:
        port = free_port(self.settings.host)
        cmd = router_command(worker_urls, port, self.settings, self.api_key)
        url = f"http://{url_host(advertised_host(self.settings.host))}:{port}"
        handle = start_process(cmd, self.settings.env, url, self.log_dir / "router.log")
        return wait_healthy(handle, "/health", self.settings.launch_timeout_s, "sglang router")

    def close(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None

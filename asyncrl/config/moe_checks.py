"""Mixture-of-experts settings a run can honour: the embedded MoE model
(`model_args.embedded_arch`) and routing replay (`actor.router_replay`). One ConfigError line
each, naming the key and the reason."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asyncrl.config.schema import Config, ConfigError
from asyncrl.config.strategy_keys import expert_problem

#: model_type values whose routers `asyncrl.moe` records and replays exactly.
MOE_TYPES = frozenset({"qwen3_moe", "qwen2_moe"})


#: The embedded models' layers and the MoE variant's experts (HF config names), which
#: `asyncrl.models.tiny.TinyModelSpec` builds by default: what these checks know of the
#: embedded model before it is built (config sits below models: it reads them from here).
EMBEDDED_LAYERS = 2
EMBEDDED_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128}


def expert_count(hf: Mapping[str, Any]) -> int:
    """Routed experts per MoE layer of an HF config (0: dense). Qwen3-MoE's config.json says
    `num_experts`; transformers 5 saves it as `num_local_experts`."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def moe_layers(hf: Mapping[str, Any]) -> tuple[int, ...]:
    """The layers of a Qwen-MoE config whose MLP routes to experts: layer i does when it is not
    in `mlp_only_layers` and (i + 1) is a multiple of `decoder_sparse_step` (transformers'
    Qwen3MoeDecoderLayer's rule); () for a dense model."""
    if not expert_count(hf):
        return ()
    step, dense = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or ())
    return tuple(
        i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0
    )


def model_config(cfg: Config) -> dict[str, Any] | None:
    """actor_train's HF config as a dict: the embedded model's (`embedded_arch`), or the model
    directory's config.json; None where it cannot be read yet (the run says why)."""
    args = cfg.actor_train.model_args
    if not args.model_name_or_path:
        if args.embedded_arch == "dense":
            return {"model_type": "qwen2", "num_hidden_layers": EMBEDDED_LAYERS}
        return {"model_type": "qwen3_moe", "num_hidden_layers": EMBEDDED_LAYERS, **EMBEDDED_MOE}
    path = Path(args.model_name_or_path) / "config.json"
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def check_moe(cfg: Config) -> None:
    for role in ("actor_infer", "reference", "critic"):
        worker = getattr(cfg, role)
        if worker is not None and worker.model_args.embedded_arch != "dense":
            raise ConfigError(
                f"{role}.model_args.embedded_arch: picks which embedded model is built, so it "
                "is read on actor_train only (every other role follows actor_train's model)"
            )
    args = cfg.actor_train.model_args
    if args.embedded_arch != "dense" and args.model_name_or_path:
        raise ConfigError(
            "actor_train.model_args.embedded_arch: picks the embedded model, so it needs an "
            f"empty model_name_or_path (got {args.model_name_or_path!r})"
        )
    check_expert_parallel(cfg)
    _check_router_replay(cfg)


def _check_router_replay(cfg: Config) -> None:
    mode, key = cfg.actor.router_replay, "actor.router_replay"
    if mode == "off":
        return
    train = cfg.actor_train
    name = train.strategy_args.strategy_name
    if mode == "r2":
        _check_r2(cfg, key)
    else:
        if name not in ("fsdp2_train", "megatron_train"):
            raise ConfigError(f"{key}: r3 is implemented in the fsdp2_train and megatron_train "
                              f"learners, not {name}")  # fmt: skip
        _check_engines_return_routes(cfg.actor_infer, key)
        if name == "megatron_train":
            _check_megatron_replay(cfg, key)
    if cfg.actor.use_dynamic_bsz:
        raise ConfigError(f"{key}: {mode} replays routes in the padded forward; the packed one "
                          "(actor.use_dynamic_bsz) does not take them")  # fmt: skip
    if name == "fsdp2_train" and train.model_args.actor_checkpointing():
        # (megatron_train recomputes by its recompute_* keys, checked above)
        # a checkpointed layer's recompute runs in the backward, outside the replayed forward:
        # its routers would route themselves and the gradients would not be the forward's
        raise ConfigError(f"{key}: {mode} needs activation checkpointing off (set actor_train."
                          "model_args.disable_gradient_checkpointing: true)")  # fmt: skip
    if cfg.actor.use_torch_compile:
        raise ConfigError(f"{key}: {mode} replays routes in eager forwards; "
                          "actor.use_torch_compile is not supported with it")  # fmt: skip
    if name == "fsdp2_train" and len(train.device_mapping) > 1:
        raise ConfigError(f"{key}: {mode} runs on a single-device learner (FSDP2 sharding with "
                          "replayed routes is untested)")  # fmt: skip
    _check_moe_model(cfg, key, mode)


def _check_r2(cfg: Config, key: str) -> None:
    """r2 replays the routes of the learner's own old-policy pass: the torch learner's no-grad
    recompute of the proximal logprobs, which only decoupled correction runs."""
    name = cfg.actor_train.strategy_args.strategy_name
    if name != "fsdp2_train":
        raise ConfigError(f"{key}: r2 is implemented in the fsdp2_train learner, not {name}")
    if cfg.algorithm.correction_mode != "decoupled":
        raise ConfigError(f"{key}: r2 replays the routes of the learner's old-policy forward; "
                          f"correction_mode {cfg.algorithm.correction_mode} runs none (its old "
                          "logprobs are the rollout's): use decoupled, or r3")  # fmt: skip


def _check_engines_return_routes(infer: Any, key: str) -> None:
    """The engines must answer `return_routed_experts`: the hf engine always can; SGLang's
    servers only when started with `--enable-return-routed-experts` (0.5.10+, its own parser
    refuses the flag before): a launched server gets it from strategy_config (a server flag),
    an attached one (`server_urls`) must have been started with it (a reply without the routes
    is refused naming the field, `engine/replies.py`)."""
    name, sc = infer.strategy_args.strategy_name, infer.strategy_args.strategy_config
    if name == "sglang" and not sc.get("server_urls"):
        if sc.get("enable_return_routed_experts") is not True:
            raise ConfigError(f"{key}: r3 with sglang engines needs them to return routed "
                              "experts: set actor_infer.strategy_args.strategy_config."
                              "enable_return_routed_experts: true (SGLang 0.5.10+)")  # fmt: skip
        if sc.get("router") is True:
            raise ConfigError(f"{key}: sglang-router drops return_routed_experts from the "
                              "requests it forwards: set actor_infer.strategy_args."
                              "strategy_config.router: auto or false (r3 reaches the "
                              "engines directly)")  # fmt: skip
    elif name not in ("sglang", "hf_infer"):
        raise ConfigError(f"{key}: r3 needs engines that return routed experts (hf_infer or "
                          f"sglang), not {name}")  # fmt: skip


#: The first megatron-core release with `megatron/core/transformer/moe/router_replay.py`.
ROUTER_REPLAY_SINCE = (0, 16, 0)


def _check_megatron_replay(cfg: Config, key: str) -> None:
    """r3 in the Megatron learner: megatron-core's router-replay hook (asyncrl.learner.megatron
    .replay), on layouts it was checked on."""
    from importlib import metadata

    try:
        version = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        version = None  # the learner says megatron-core is missing, with the install line
    if version is not None:
        from packaging.version import Version

        if Version(version).release[:3] < ROUTER_REPLAY_SINCE:
            raise ConfigError(f"{key}: r3 with megatron_train needs megatron-core's router "
                              f"replay (0.16+), not in megatron-core {version}")  # fmt: skip
    sc = cfg.actor_train.strategy_args.strategy_config
    if sc.get("sequence_parallel"):
        raise ConfigError(f"{key}: r3 with sequence_parallel is not supported by megatron_train "
                          "(its routers see a TP-scattered sequence)")  # fmt: skip
    if (sc.get("pipeline_model_parallel_size") or 1) > 1:
        raise ConfigError(f"{key}: r3 with megatron_train is checked without "
                          "pipeline_model_parallel_size; it is not supported with it yet")  # fmt: skip
    if sc.get("recompute_granularity"):
        raise ConfigError(f"{key}: r3 needs Megatron's activation recompute off (a recomputed "
                          "forward would route itself): unset recompute_granularity")  # fmt: skip


def check_expert_parallel(cfg: Config) -> None:
    """megatron_train's expert parallel sizes against the policy's experts and the ranks
    (`strategy_keys.expert_problem`); skipped where the model's config cannot be read yet."""
    train = cfg.actor_train
    if train.strategy_args.strategy_name != "megatron_train":
        return
    hf = model_config(cfg)
    if hf is None:
        return
    world = max(1, len(train.device_mapping))
    problem = expert_problem(hf, train.strategy_args.strategy_config, world)
    if problem:
        raise ConfigError(f"actor_train.strategy_args.{problem}")


def _check_moe_model(cfg: Config, key: str, mode: str) -> None:
    """The policy must be a mixture of experts whose routers `asyncrl.moe` knows."""
    args = cfg.actor_train.model_args
    if not args.model_name_or_path:
        if args.embedded_arch != "moe":
            raise ConfigError(f"{key}: {mode} needs a mixture-of-experts policy; the embedded "
                              "model is dense (set actor_train.model_args.embedded_arch: moe)")  # fmt: skip
        return
    config = Path(args.model_name_or_path) / "config.json"
    if not config.is_file():
        return  # the run refuses a missing model directory itself, with its path
    try:
        kind = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # unreadable: the model load says why
    if kind not in MOE_TYPES:
        raise ConfigError(f"{key}: {mode} needs a mixture-of-experts policy ({sorted(MOE_TYPES)}); "
                          f"{args.model_name_or_path} is {kind!r}")  # fmt: skip

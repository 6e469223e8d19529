"""Building one rank's Megatron model: process groups, TransformerConfig, layer spec, GPTModel
with HF weights (built-in mapping or Megatron-Bridge), DDP and the Megatron optimizer.

Megatron-core 0.15-0.19 APIs (their differences in `compat.py`), imported inside the functions
only. The local layer spec needs no Transformer Engine; sequence parallelism does (Megatron's
local RMSNorm refuses it), which is checked here with an error naming the option. Context
parallelism on the local spec uses asyncrl's all-gather CP attention (`context.py`); Transformer
Engine's attention does its own.

Virtual pipeline stages (`virtual_pipeline_model_parallel_size` V): every pipeline rank builds
V model chunks, chunk v of rank r holding layers of virtual stage v·PP + r; the model is always
a list of chunks (one without VPP), which is what Megatron's schedules, DDP wrapping and the
optimizer take.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrl.device import DeviceSpec, select_device
from asyncrl.learner.megatron.args import TRANSFORMER, MegatronConfigError, MegatronPlan
from asyncrl.learner.megatron.compat import check_version, router_gemm_fallback
from asyncrl.learner.megatron.name_mapping import ModelShape
from asyncrl.learner.megatron.weights import HFCheckpoint, load_hf_into, stage_layout, unwrap
from asyncrl.learner.placement import Rendezvous


@dataclass
class Built:
    chunks: list[torch.nn.Module]
    """This rank's model chunks (one per virtual stage): DDP-wrapped when trainable (Bridge) or
    still bare (built-in: wrapped by `wrap`)."""
    te: bool
    """Transformer Engine layer spec (fused pre-norm names)."""
    layout: list[list[tuple[int, int]]]
    """(first layer, layer count) per pipeline rank, per virtual stage (chunk)."""
    bridge: Any = None
    """The AutoBridge instance when Megatron-Bridge built the model."""


def init_distributed(device: DeviceSpec, rank: int, world: int, meet: Rendezvous | str | None,
                     local: int) -> None:  # fmt: skip
    """Join the ranks' default group at `meet` (a Rendezvous, or an init URL); a lone rank
    needs none: it keeps its store in memory (no port, no file another process could join)."""
    select_device(local, device.kind)
    if torch.distributed.is_initialized():
        return
    if isinstance(meet, Rendezvous):
        meet.join(rank, world, device.backend)
    elif meet is not None:
        torch.distributed.init_process_group(
            device.backend, init_method=meet, rank=rank, world_size=world
        )
    elif world == 1:
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group(device.backend, store=store, rank=0, world_size=1)
    else:
        raise ValueError(f"rank {rank} of {world}: a multi-rank learner needs a rendezvous")


def init_parallel(plan: MegatronPlan, seed: int, timeout_s: float | None = None) -> None:
    """Megatron's parallel groups; `timeout_s` (`cluster.collective_timeout_s`, whole
    minutes for Megatron, at least 1) bounds their collectives as the default group's."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    check_version()  # one line on a megatron-core no test has run, before any group is made
    par = dict(plan.parallel)
    if timeout_s is not None:
        par["distributed_timeout_minutes"] = max(1, -(-int(timeout_s) // 60))
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(**par)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def bridge_class(wanted: bool | str) -> Any:
    """Megatron-Bridge's AutoBridge when it is to be used (true, or auto and installed)."""
    if wanted is False:
        return None
    try:
        from megatron.bridge import AutoBridge
    except ImportError:
        if wanted is True:
            raise ImportError("use_bridge: true, but megatron-bridge is not installed") from None
        return None
    return AutoBridge


def transformer_config(plan: MegatronPlan, device: DeviceSpec) -> Any:
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(plan.transformer)
    kwargs["activation_func"] = {"silu": F.silu, "gelu": F.gelu}[kwargs["activation_func"]]
    for key in ("params_dtype", "pipeline_dtype"):
        kwargs[key] = getattr(torch, kwargs[key])
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in known}
    if extra and device.kind != "npu":
        raise MegatronConfigError(
            f"override_transformer_config.{next(iter(extra))} is not a TransformerConfig field "
            "of this megatron-core (MindSpeed's keys need the Ascend stack)"
        )
    config = TransformerConfig(**kwargs)
    for key, value in extra.items():  # MindSpeed's features read their switches from here
        setattr(config, key, value)
    return config


def layer_spec(plan: MegatronPlan, config: Any, device: DeviceSpec,
               vp_stage: int | None = None) -> tuple[Any, bool]:  # fmt: skip
    """The layer spec (a block spec for a model of MoE and dense layers: chunk `vp_stage`'s
    layers) and whether it is Transformer Engine's."""
    impl = plan.transformer_impl
    if impl == "auto":
        try:
            import transformer_engine  # noqa: F401

            impl = "transformer_engine"
        except ImportError:
            impl = "local"
    from megatron.core.models.gpt import gpt_layer_specs as specs

    te = impl == "transformer_engine"
    if not te and config.sequence_parallel and device.kind != "npu":  # MindSpeed patches it
        raise MegatronConfigError(
            "sequence_parallel needs transformer_impl: transformer_engine (Megatron's local layer "
            "spec normalises with torch's RMSNorm, which refuses it)"
        )
    if isinstance(config.moe_layer_freq, list) and config.num_moe_experts:
        block = specs.get_gpt_decoder_block_spec(config, te, "RMSNorm", vp_stage=vp_stage)
        layers = block.layer_specs
    elif te:
        block = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm
        )
        return block, True
    else:
        block = specs.get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                               normalization="RMSNorm",
                                               qk_layernorm=config.qk_layernorm)  # fmt: skip
        layers = [block]
    if config.context_parallel_size > 1 and not te:  # Megatron's local attention refuses CP
        from asyncrl.learner.megatron.context import ContextParallelAttention

        for spec in layers:
            spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    return block, te


def virtual_stages(plan: MegatronPlan) -> list[int | None]:
    """The vp_stage of every model chunk of this rank ([None] without virtual stages)."""
    vpp = plan.parallel["virtual_pipeline_model_parallel_size"]
    return list(range(vpp)) if vpp is not None else [None]


def current_device(device: DeviceSpec) -> torch.device:
    """This process's current accelerator of `device`'s kind (`select_device` set it)."""
    if device.kind == "cpu":
        return torch.device("cpu")
    return device.torch_device(getattr(torch, device.kind).current_device())


def build_builtin(plan: MegatronPlan, shape: ModelShape, path: Path, device: DeviceSpec,
                  trainable: bool) -> Built:  # fmt: skip
    """GPTModel chunks of this pipeline rank with this rank's HF weight shards loaded."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    config = transformer_config(plan, device)
    if config.num_moe_experts:
        router_gemm_fallback()
    layout = stage_layout(config, ps.get_pipeline_model_parallel_world_size())
    checkpoint = HFCheckpoint(path)
    chunks = []
    for vp in virtual_stages(plan):
        first = ps.is_pipeline_first_stage(ignore_virtual=vp is None, vp_stage=vp)
        last = ps.is_pipeline_last_stage(ignore_virtual=vp is None, vp_stage=vp)
        spec, te = layer_spec(plan, config, device, vp)
        model = GPTModel(config=config, transformer_layer_spec=spec, pre_process=first,
                         post_process=last, vp_stage=vp, **plan.model)  # fmt: skip
        # Megatron's parallel layers are made on the current accelerator, a local spec's norm
        # (torch's RMSNorm) on the default device: the whole chunk goes where it trains, as
        # Megatron's own get_model does, before the fp16 wrapper, DDP and the optimizer.
        model.to(current_device(device))
        offset = layout[ps.get_pipeline_model_parallel_rank()][vp or 0][0]
        load_hf_into(model, checkpoint, shape, te, offset)
        if config.bf16 or config.fp16:
            model = Float16Module(config, model)
        if not trainable:
            model.eval().requires_grad_(False)
        chunks.append(model)
    return Built(chunks, te, layout)


def build_with_bridge(auto_bridge: Any, plan: MegatronPlan, sc: dict, path: Path,
                      trainable: bool) -> Built:  # fmt: skip
    """AutoBridge: provider from the HF config, our parallel sizes and knobs, HF weights; the
    provider wraps the trainable model in DDP itself."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig

    bridge = auto_bridge.from_hf_pretrained(str(path))
    provider = bridge.to_megatron_provider(load_weights=True)
    knobs = {k: sc[k] for k in TRANSFORMER if k in sc}
    knobs.update({k: v for k, v in sc.items() if k.startswith("moe_")})
    knobs.update(dict(sc.get("override_transformer_config") or {}))
    for key, value in {**plan.parallel, **knobs}.items():
        setattr(provider, key, value)
    provider.finalize()
    chunks = provider.provide_distributed_model(
        ddp_config=DistributedDataParallelConfig(**plan.ddp), wrap_with_ddp=trainable,
        bf16=plan.optimizer["bf16"], fp16=plan.optimizer["fp16"],
    )  # fmt: skip
    if not trainable:
        chunks = [c.eval().requires_grad_(False) for c in chunks]
    config = unwrap(chunks[0]).config
    layout = stage_layout(config, ps.get_pipeline_model_parallel_world_size())
    return Built(list(chunks), True, layout, bridge)


def wrap(built: Built, plan: MegatronPlan) -> tuple[list[torch.nn.Module], Any, Any]:
    """(DDP model chunks, Megatron optimizer, TransformerConfig) with the schedule's hooks set."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = unwrap(built.chunks[0]).config
    if built.bridge is not None:
        chunks = built.chunks
    else:  # as Megatron's training loop: only the first chunk splits its grads into buckets
        ddp_config = DistributedDataParallelConfig(**plan.ddp)
        chunks = [DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0)
                  for i, c in enumerate(built.chunks)]  # fmt: skip
    opt_kwargs = dict(plan.optimizer, params_dtype=config.params_dtype)
    optimizer = get_megatron_optimizer(OptimizerConfig(**opt_kwargs), chunks)
    config.finalize_model_grads_func = finalize_model_grads
    one = len(chunks) == 1
    config.no_sync_func = chunks[0].no_sync if one else [c.no_sync for c in chunks]
    config.grad_scale_func = optimizer.scale_loss
    if plan.ddp.get("overlap_param_gather"):
        syncs = [c.start_param_sync for c in chunks]
        config.param_sync_func = syncs[0] if one else syncs
    return chunks, optimizer, config

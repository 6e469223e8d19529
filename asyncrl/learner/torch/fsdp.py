"""FSDP2 sharding of the torch learner's models when `actor_train.device_mapping` has > 1 device.

`shard` applies `torch.distributed.fsdp.fully_shard` over a 1-D `DeviceMesh` of the default
process group: once per decoder layer (each layer's parameters are all-gathered just before its
forward/backward and freed after), then the root (embeddings, final norm, LM head). Parameters,
gradients and the optimizer state built over them (AdamW's moments are shaped like the local
shard) live 1/W on each rank. Every forward and backward is therefore a collective: every rank
must run the same number of them, in the same order (the learner pads with zero-loss passes).

Precision: on an accelerator with `model_args.dtype` bf16/fp16 the master weights stay fp32 and
FSDP's MixedPrecisionPolicy computes in that dtype and reduces gradients in fp32. On the CPU
the model keeps the configured dtype (fp32 by default) and no policy applies: CPU kernels gain
nothing from bf16 compute here, and a run that equals the one-process run to 1e-5 needs fp32.

Activation checkpointing stays the model's own (transformers checkpoints each decoder layer),
which composes with fully_shard. `strategy_config.offload_params` (CPUOffloadPolicy: parameters,
gradients and, since the optimizer steps where its parameters are, the optimizer state on the
host; `offload_optimizer` names the same policy) applies on accelerators only: a machine without
one refuses it before the run (asyncrl.preflight).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from asyncrl.config.learner_checks import FSDP_OFFLOAD
from asyncrl.config.strategy_keys import strategy_option
from asyncrl.learner.dtensor import local_value

# The DCP directory inside a checkpoint that holds the sharded model and optimizer.
SHARDED_DIR = "learner"


def sharded(world_size: int) -> bool:
    """Whether the learner shards its models (FSDP2): more than one rank."""
    return world_size > 1


def master_dtype(dtype: torch.dtype, device: str, world_size: int) -> torch.dtype:
    """The dtype to load the trained weights in: fp32 masters under a mixed precision policy
    (sharded, on an accelerator, a half dtype configured), else the configured dtype."""
    if sharded(world_size) and _accelerator(device) and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def _accelerator(device: str) -> bool:
    return torch.device(device).type != "cpu"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks: the modules whose class HF marks as never to be split
    (`_no_split_modules`, e.g. Qwen2DecoderLayer), found inside a peft wrapper too."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard(
    model: torch.nn.Module,
    device: str,
    compute_dtype: torch.dtype | None = None,
    offload: bool = False,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """`model` sharded in place over every rank of the default group (fully_shard per decoder
    layer, then the root); `compute_dtype`: the mixed precision param dtype (accelerators)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(torch.device(device).type, (torch.distributed.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if compute_dtype is not None and _accelerator(device):
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=torch.float32
        )
    if offload and _accelerator(device):
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def shard_learner(
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
    train: Any,
    device: str,
    compute_dtype: torch.dtype,
) -> None:
    """Shard the policy (`train`: actor_train's section) and a reference model of its own (the
    frozen copy or the configured one: sharded for inference alike) in place. A LoRA policy
    (peft) is sharded whole, base and adapter alike: only the adapter's shards train."""
    args = train.strategy_args  # validation: the two keys agree (verl's names folded in)
    offload = any(strategy_option("actor_train", args, k) for k in FSDP_OFFLOAD)
    shard(model, device, compute_dtype, offload)
    if reference is not None:
        shard(reference, device, compute_dtype, offload)


def set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """FSDP2's no_sync: gradients accumulate locally (unreduced) until a pass with sync on."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(enabled)


def full_tensors(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) per state-dict entry but the tied copies (`lora.tied_copies`: a
    tied `lm_head.weight`), gathered one at a time from the shards (an all-gather per DTensor:
    every rank must iterate this to the end, in this order). `dtype`: cast floating tensors to
    it (the compute dtype the engines expect)."""
    from asyncrl.learner import lora

    skip = lora.tied_copies(model)
    for name, value in model.state_dict().items():
        if name in skip:
            continue
        tensor = local_value(value.detach())
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name, tensor


def drain(tensors: Iterator[Any]) -> None:
    """Run an iterator of collectives to its end, discarding what it yields (remote ranks)."""
    for _ in tensors:
        pass


def mean_over_ranks(metrics: dict[str, float], world_size: int) -> dict[str, float]:
    """Every rank computes the same metric keys on its shard; their mean over the ranks."""
    if world_size == 1:
        return metrics
    keys = sorted(metrics)
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
    torch.distributed.all_reduce(values)
    return {k: float(v) / world_size for k, v in zip(keys, values, strict=True)}


def own_rows(total_rows: int, rank: int, world_size: int) -> torch.Tensor:
    """The global rows a rank holds: row r lives on rank r % world_size."""
    return torch.arange(rank, total_rows, world_size)


def gather_rows(local: torch.Tensor, total_rows: int, world_size: int) -> torch.Tensor:
    """The whole batch's [total_rows, ...] from every rank's `own_rows` part (a collective:
    every rank calls it in the same order). Parts differ by one row at most: each is padded to
    the longest for the all-gather and cut back when interleaved."""
    if world_size == 1:
        return local
    longest = -(-total_rows // world_size)
    padded = local.new_zeros((longest, *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    torch.distributed.all_gather(parts, padded.contiguous())
    out = local.new_empty((total_rows, *local.shape[1:]))
    for rank, part in enumerate(parts):
        rows = own_rows(total_rows, rank, world_size)
        out[rows] = part[: len(rows)].to(out.device)
    return out


# -- checkpoints: torch.distributed.checkpoint (DCP) ------------------------------------------
Modules = dict[str, torch.nn.Module]  # "model" (the one the optimizer trains), "reference", ...


def dcp_state(modules: Modules, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Each module's state (and the optimizer's) keyed by parameter name (FQN), DTensors when
    sharded: what DCP saves per rank and loads onto any rank count."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state = {name: get_model_state_dict(module) for name, module in modules.items()}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(modules["model"], optimizer)
    return state


def apply_dcp_state(
    modules: Modules,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    full: bool = False,
    lora_only: bool = False,
) -> None:
    """Load `dcp_state`-shaped values (`full`: whole tensors, every rank a copy) into the
    modules and the optimizer; the parts `state` lacks are left as they are (`lora_only`: the
    model's entries are its adapter's alone)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # LoRA: a one-process save holds the adapter only (the base is the model directory)
    options = StateDictOptions(full_state_dict=full, strict=not lora_only)
    for name, module in modules.items():
        if name in state:
            set_model_state_dict(module, state[name], options=options)
    if optimizer is not None and "optimizer" in state:
        set_optimizer_state_dict(modules["model"], optimizer, state["optimizer"], options=options)


def save_sharded(state: dict[str, Any], path: str | Path, group: Any = None) -> None:
    """Write `dcp_state` into the DCP directory `path`: each rank its own shards (a collective
    over `group`: every rank calls it); `.metadata`, written last, marks it complete."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path), process_group=group)


def async_save_sharded(state: dict[str, Any], path: str | Path, group: Any) -> Future:
    """`save_sharded` in a background thread: the shards are staged on the CPU before this
    returns (training may change the originals), written later; `.result()` waits (raises)."""
    import threading

    staged = stage_to_cpu(state)
    done: Future = Future()

    def write() -> None:
        try:
            save_sharded(staged, path, group)
            done.set_result(None)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(e)

    threading.Thread(target=write, name="asyncrl-ckpt-shards", daemon=True).start()
    return done


def stage_to_cpu(value: Any) -> Any:
    """A copy of a (nested) state on the CPU, DTensors kept as DTensors of copied shards: a
    snapshot that later training steps (in-place optimizer updates) cannot change."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())  # fmt: skip
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: stage_to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(stage_to_cpu(v) for v in value)
    return value


def load_sharded(
    modules: Modules,
    optimizer: torch.optim.Optimizer | None,
    path: str | Path,
    distributed: bool = True,
) -> None:
    """Load a DCP directory written by any rank count: each part it holds (the optimizer only
    when given) into this rank's modules; DCP reads the pieces of the saved shards it needs."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    parts = {k.split(".", 1)[0] for k in saved}
    wanted = {name: m for name, m in modules.items() if name in parts}
    state = dcp_state(wanted, optimizer if "optimizer" in parts and "model" in wanted else None)
    # one process reads alone, even where a default process group exists for something else
    dcp.load(state, checkpoint_id=str(path), no_dist=not distributed)
    apply_dcp_state(wanted, optimizer, state)


def load_full(
    modules: Modules,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    lora_on: bool = False,
) -> None:
    """Distribute a one-process state (`learner.pt`: whole tensors, the optimizer's numbered
    in optimizer order; with LoRA the adapter only, in peft's keys) into this rank's shards."""
    from asyncrl.learner import lora

    full = {name: state[name] for name in modules if isinstance(state.get(name), dict)}
    if lora_on:
        full["model"] = lora.under_model_names(modules["model"], full["model"])
    if optimizer is not None and isinstance(state.get("optimizer"), dict):
        full["optimizer"] = named_optimizer_state(modules["model"], optimizer, state["optimizer"])
    apply_dcp_state(modules, optimizer, full, full=True, lora_only=lora_on)


def named_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> dict[str, Any]:
    """A one-process `optimizer.state_dict()` (parameters numbered in optimizer order) keyed by
    parameter name instead, as `set_optimizer_state_dict` reads it."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {order[i]: s for i, s in state["state"].items()}, "param_groups": groups}


def model_state(
    modules: Modules, optimizer: torch.optim.Optimizer, lora_on: bool, world_size: int
) -> dict[str, Any]:
    """The learner state's model, optimizer and frozen reference: "sharded" markers when
    sharded (`dcp_state` holds them), else whole (with LoRA the adapter only: the base never
    changes, it is the model directory)."""
    from asyncrl.learner import lora

    if sharded(world_size):
        return dict.fromkeys([*modules, "optimizer"], "sharded")
    model = modules["model"]
    return {
        "model": lora.adapter_state(model) if lora_on else model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "reference": modules["reference"].state_dict() if "reference" in modules else None,
    }


def load_model_state(
    modules: Modules,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    lora_rank: int,
    world_size: int,
) -> None:
    """Load what `model_state` saved, from any rank count: a sharded save from its DCP
    directory (`state["sharded_dir"]`), a whole one into this rank's shards or as it is. A
    configured reference comes from its model directory, whatever a checkpoint holds."""
    from asyncrl.learner import lora

    if "model" in state:  # a checkpoint with(out) an adapter into a learner without (with) one
        lora.check_kind(state, lora_rank)
    if state.get("model") == "sharded":
        optim = optimizer if state.get("optimizer") == "sharded" else None
        load_sharded(modules, optim, state["sharded_dir"], distributed=sharded(world_size))
    elif sharded(world_size) and "model" in state:  # a one-process learner.pt
        load_full(modules, optimizer if "optimizer" in state else None, state, lora_rank > 0)
    else:
        if "model" in state:  # the full model, or with LoRA the adapter only
            lora.load_model_state(modules["model"], state, lora_rank)
        if "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
        if "reference" in modules and state.get("reference") is not None:
            modules["reference"].load_state_dict(state["reference"])


def save_full(
    model: torch.nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], path: str | Path | None
) -> None:
    """HF export of a sharded model: every rank runs the gathers of `tensors`; the rank given
    a `path` (rank 0) keeps them on the CPU and writes the directory."""
    if path is None:
        drain(tensors)
        return
    pretrained_snapshot(model, tensors)(Path(path))


def _own_class_name(model: torch.nn.Module) -> str:
    """transformers' class of `model` (FSDP2 subclasses it; the lean policy names its own)."""
    if named := getattr(model, "hf_class_name", None):
        return named
    from torch.distributed.fsdp import FSDPModule

    return next(c.__name__ for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def pretrained_snapshot(
    model: torch.nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]
) -> Callable[[Path], None]:
    """The HF export of `model` in two halves: `tensors` (full, HF names) copied to the CPU now,
    and the returned writer of the directory (config, generation config, safetensors), which
    touches nothing live and may run on another thread (`actor.checkpoint.async_save`)."""
    import copy

    from asyncrl.learner import lora

    state = {name: t.detach().to("cpu", copy=True) for name, t in tensors}
    for key in lora.tied_copies(model):  # as HF's save_pretrained: a tied copy is not written
        state.pop(key, None)
    config = copy.deepcopy(model.config)
    config.architectures = [_own_class_name(model)]
    generation = copy.deepcopy(getattr(model, "generation_config", None))

    def write(path: Path) -> None:
        from safetensors.torch import save_file

        Path(path).mkdir(parents=True, exist_ok=True)
        config.save_pretrained(path)
        if generation is not None:
            generation.save_pretrained(path)
        tensors = {k: v.contiguous() for k, v in state.items()}
        save_file(tensors, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})

    return write

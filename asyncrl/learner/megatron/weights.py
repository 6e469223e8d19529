"""HF weights into and out of a (TP/PP-sharded) Megatron GPTModel, by `hf_megatron` rules.

Loading reads each rank's own shards lazily from the safetensors files (no rank ever holds the
whole model), chunk by chunk under virtual pipeline stages (each chunk's layers at its own
global offset). Export is a generator every rank of DP/CP replica 0 walks in lockstep: the
owning pipeline stage (and chunk) all-gathers a parameter over its TP group, broadcasts it over
the pipeline group and global rank 0 converts it to HF tensors and yields them; the other ranks
yield nothing.
With Megatron-Bridge both directions go through `AutoBridge` instead (MoE/EP included).
Megatron is imported inside the functions only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from asyncrl.learner.megatron.name_mapping import (
    MappingError,
    ModelShape,
    Rule,
    expert_local_name,
    rules,
    to_hf,
    to_megatron,
    tp_merge,
    tp_split,
    with_layer_offset,
)


class HFCheckpoint:
    """Lazy access to the tensors of an HF model directory (safetensors, sharded or not)."""

    def __init__(self, model_path: str | Path) -> None:
        self.root = Path(model_path)
        index = self.root / "model.safetensors.index.json"
        if index.exists():
            self.where = json.loads(index.read_text())["weight_map"]
        else:
            from safetensors import safe_open

            files = sorted(self.root.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.root} has no safetensors weights")
            self.where = {}
            for f in files:
                with safe_open(f, "pt") as handle:
                    self.where.update({k: f.name for k in handle.keys()})
        self._open: dict[str, Any] = {}

    def __call__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.where:
            raise MappingError(f"{self.root}: no tensor {name!r} in the checkpoint")
        file = self.where[name]
        if file not in self._open:
            self._open[file] = safe_open(self.root / file, "pt")
        return self._open[file].get_tensor(name)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def stage_layout(config: Any, pp: int) -> list[list[tuple[int, int]]]:
    """(first global layer, layer count) of every model chunk: [pipeline rank][virtual stage]
    (one chunk per rank without virtual pipeline stages)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vpp = config.virtual_pipeline_model_parallel_size
    stages = list(range(vpp)) if vpp is not None else [None]
    offsets = {(r, v or 0): get_transformer_layer_offset(config, vp_stage=v, pp_rank=r)
               for r in range(pp) for v in stages}  # fmt: skip
    starts = sorted(set(offsets.values())) + [config.num_layers]
    count = {o: e - o for o, e in zip(starts, starts[1:])}
    return [[(offsets[r, v], count[offsets[r, v]]) for v in range(len(stages))] for r in range(pp)]


def owner_chunk(rule: Rule, layout: list[list[tuple[int, int]]]) -> tuple[int, int]:
    """(pipeline rank, chunk) holding the parameter of `rule`."""
    if rule.layer is not None:
        return next((r, v) for r, chunks in enumerate(layout)
                    for v, (o, n) in enumerate(chunks) if o <= rule.layer < o + n)  # fmt: skip
    if rule.mcore.startswith("embedding."):
        return 0, 0
    return len(layout) - 1, len(layout[-1]) - 1


def _local_name(rule: Rule, offset: int) -> str:
    return rule.mcore if rule.layer is None else with_layer_offset(rule.mcore, -offset)


def expert_split(shape: ModelShape) -> tuple[int, int, int, int]:
    """(first global expert of this EP rank, experts per EP rank, ETP size, ETP rank)."""
    from megatron.core import parallel_state as ps

    if not shape.num_experts:
        return 0, 0, 1, 0
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    per = shape.num_experts // ep
    etp = ps.get_expert_tensor_parallel_world_size()
    return ep_rank * per, per, etp, ps.get_expert_tensor_parallel_rank()


def load_hf_into(
    model: torch.nn.Module,
    get_hf: Callable[[str], torch.Tensor],
    shape: ModelShape,
    te: bool,
    offset: int,
) -> None:
    """Copy this rank's TP shard of every HF-derived tensor into `model` (before DDP wraps it);
    of its own experts' tensors (expert parallel) their ETP shard."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    first, _, etp, etp_rank = expert_split(shape)
    params = dict(unwrap(model).named_parameters())
    shape_rules = rules(shape, te)
    by_local = {expert_local_name(_local_name(r, offset), first): r for r in shape_rules}
    if shape.tie_word_embeddings:  # a last pipeline stage holds its own copy of the embedding
        by_local["output_layer.weight"] = shape_rules[0]
    missing = sorted(n for n in params if n not in by_local)
    if missing:
        raise MappingError(f"no HF source for Megatron parameters {missing[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            rule = by_local[name]
            full = to_megatron(rule, [get_hf(n) for n in rule.hf], shape)
            if rule.expert is None:
                shard = tp_split(rule, full, tp, shape)[tp_rank]
            else:
                shard = tp_split(rule, full, etp, shape)[etp_rank]
            if tuple(shard.shape) != tuple(param.shape):
                raise MappingError(f"{name}: shard {tuple(shard.shape)} vs {tuple(param.shape)}")
            param.copy_(shard.to(param.dtype))


def _gather_tp(rule: Rule, shard: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """The full tensor from this rank's shard: over the TP group, or an expert's over ETP."""
    from megatron.core import parallel_state as ps

    if rule.expert is None:
        group = ps.get_tensor_model_parallel_group()
        tp = ps.get_tensor_model_parallel_world_size()
    else:
        group = ps.get_expert_tensor_parallel_group()
        tp = ps.get_expert_tensor_parallel_world_size()
    if rule.tp == "none" or tp == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(tp)]
    torch.distributed.all_gather(parts, shard.contiguous(), group=group)
    return tp_merge(rule, parts, shape)


def _expert_tensor(rule: Rule, params: dict, shape: ModelShape) -> torch.Tensor:
    """Expert `rule.expert`'s full tensor on every rank of this EP group: ETP-gathered on its
    owner EP rank, broadcast from there."""
    from megatron.core import parallel_state as ps

    first, per, _, _ = expert_split(shape)
    owner = rule.expert // per
    full = None
    if first <= rule.expert < first + per:
        full = _gather_tp(rule, params[expert_local_name(rule.mcore, first)].detach(), shape)
    group = ps.get_expert_model_parallel_group()
    if ps.get_expert_model_parallel_world_size() > 1:
        if full is None:
            ref = next(iter(params.values()))
            full = torch.empty(rule.shape, dtype=ref.dtype, device=ref.device)
        src = torch.distributed.get_process_group_ranks(group)[owner]
        torch.distributed.broadcast(full, src=src, group=group)
    return full


def export_hf(
    chunks: list[torch.nn.Module], shape: ModelShape, te: bool, layout: list[list[tuple[int, int]]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors on global rank 0 (see module docstring); a generator every rank of
    DP/CP replica 0 must drive to the end (and, with experts, every rank of expert-DP replica 0:
    the experts' EP ranks need not be DP rank 0)."""
    from megatron.core import parallel_state as ps

    dense = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    experts = bool(shape.num_experts) and ps.get_expert_data_parallel_rank() == 0
    if not dense and not experts:
        return
    if experts and len(layout) > 1:
        raise MappingError("exporting experts under pipeline parallelism is not built in "
                           "(use Megatron-Bridge)")  # fmt: skip
    stage = ps.get_pipeline_model_parallel_rank()
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = torch.distributed.get_process_group_ranks(pp_group)
    params = [dict(unwrap(c).named_parameters()) for c in chunks]
    first = next(iter(params[0].values()))
    # The buffers a stage receives into sit beside this rank's own parameters: never on the
    # current device of whichever thread drives the export.
    dtype, device = first.dtype, first.device
    sender = torch.distributed.get_rank() == 0
    for rule in rules(shape, te):
        if rule.expert is not None:
            if experts:
                full = _expert_tensor(rule, params[0], shape)
                if sender:
                    yield from to_hf(rule, full, shape)
            continue
        if not dense:
            continue
        owner, chunk = owner_chunk(rule, layout)
        full = None
        if owner == stage:
            local = _local_name(rule, layout[stage][chunk][0])
            full = _gather_tp(rule, params[chunk][local].detach(), shape)
        if len(layout) > 1:
            if full is None:
                full = torch.empty(rule.shape, dtype=dtype, device=device)
            torch.distributed.broadcast(full, src=pp_ranks[owner], group=pp_group)
        if sender:
            yield from to_hf(rule, full, shape)


def export_with_bridge(bridge: Any, chunks: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron-Bridge's streaming export (all ranks get full tensors); yield on rank 0 only."""
    rank0 = torch.distributed.get_rank() == 0
    for name, tensor in bridge.export_hf_weights(chunks, cpu=False, show_progress=False):
        if rank0:
            yield name, tensor


def save_hf(named: Iterator[tuple[str, torch.Tensor]], src: Path, dst: Path) -> None:
    """Write HF safetensors shards (~2 GB) plus config files; rank 0 gets tensors, others none."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    size, index, weight_map = 0, 0, {}

    def flush() -> None:
        nonlocal shard, size, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, dst / name, metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size, index = {}, 0, index + 1

    for name, tensor in named:
        shard[name] = tensor.detach().to("cpu").contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= 2 * 1024**3:
            flush()
    flush()
    if weight_map:
        index_json = {"metadata": {}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=1))
        for extra in ("config.json", "generation_config.json"):
            if (src / extra).exists():
                (dst / extra).write_text((src / extra).read_text())

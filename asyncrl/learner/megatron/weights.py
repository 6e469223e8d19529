"""HF weights into and out of a (TP/PP-sharded) Megatron GPTModel, by `hf_megatron` rules.

Loading reads each rank's own shards lazily from the safetensors files (no rank ever holds the
whole model). Export is a generator every rank of DP/CP replica 0 walks in lockstep: the owning
pipeline stage all-gathers a parameter over its TP group, broadcasts it over the pipeline group
and global rank 0 converts it to HF tensors and yields them; the other ranks yield nothing.
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


def stage_layout(config: Any, pp: int) -> list[tuple[int, int]]:
    """(first global layer, layer count) of every pipeline stage."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offsets = [get_transformer_layer_offset(config, pp_rank=s) for s in range(pp)]
    ends = offsets[1:] + [config.num_layers]
    return [(o, e - o) for o, e in zip(offsets, ends)]


def owner_stage(rule: Rule, layout: list[tuple[int, int]]) -> int:
    if rule.layer is not None:
        return next(s for s, (o, n) in enumerate(layout) if o <= rule.layer < o + n)
    return 0 if rule.mcore.startswith("embedding.") else len(layout) - 1


def _local_name(rule: Rule, offset: int) -> str:
    return rule.mcore if rule.layer is None else with_layer_offset(rule.mcore, -offset)


def load_hf_into(
    model: torch.nn.Module,
    get_hf: Callable[[str], torch.Tensor],
    shape: ModelShape,
    te: bool,
    offset: int,
) -> None:
    """Copy this rank's TP shard of every HF-derived tensor into `model` (before DDP wraps it)."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    params = dict(unwrap(model).named_parameters())
    shape_rules = rules(shape, te)
    by_local = {_local_name(r, offset): r for r in shape_rules}
    if shape.tie_word_embeddings:  # a last pipeline stage holds its own copy of the embedding
        by_local["output_layer.weight"] = shape_rules[0]
    missing = sorted(n for n in params if n not in by_local)
    if missing:
        raise MappingError(f"no HF source for Megatron parameters {missing[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            rule = by_local[name]
            full = to_megatron(rule, [get_hf(n) for n in rule.hf], shape)
            shard = tp_split(rule, full, tp, shape)[tp_rank]
            if tuple(shard.shape) != tuple(param.shape):
                raise MappingError(f"{name}: shard {tuple(shard.shape)} vs {tuple(param.shape)}")
            param.copy_(shard.to(param.dtype))


def _gather_tp(rule: Rule, shard: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if rule.tp == "none" or tp == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(tp)]
    torch.distributed.all_gather(
        parts, shard.contiguous(), group=ps.get_tensor_model_parallel_group()
    )
    return tp_merge(rule, parts, shape)


def export_hf(
    model: torch.nn.Module, shape: ModelShape, te: bool, layout: list[tuple[int, int]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors on global rank 0 (see module docstring); a generator every rank of
    DP/CP replica 0 must drive to the end."""
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_rank() != 0 or ps.get_context_parallel_rank() != 0:
        return
    stage = ps.get_pipeline_model_parallel_rank()
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = torch.distributed.get_process_group_ranks(pp_group)
    params = dict(unwrap(model).named_parameters())
    dtype = next(iter(params.values())).dtype
    sender = torch.distributed.get_rank() == 0
    for rule in rules(shape, te):
        owner = owner_stage(rule, layout)
        full = None
        if owner == stage:
            full = _gather_tp(rule, params[_local_name(rule, layout[stage][0])].detach(), shape)
        if len(layout) > 1:
            if full is None:
                full = torch.empty(rule.shape, dtype=dtype, device=torch.cuda.current_device())
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

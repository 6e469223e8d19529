"""The Megatron worker's weights and state (`MegatronWorkerState`, which `MegatronWorker`
extends): full HF tensors for the engines' weight sync, HF weights loaded into this rank's
shards, this rank's optimizer state, and the sharded checkpoint every rank writes and reads by
Megatron's distributed checkpointing (`dist_ckpt`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from asyncrl.learner.megatron.args import MegatronPlan
from asyncrl.learner.megatron.build import Built
from asyncrl.learner.megatron.name_mapping import ModelShape
from asyncrl.learner.megatron.weights import export_hf, export_with_bridge, load_hf_into, save_hf


class MegatronWorkerState:
    """`MegatronWorker`'s weights and state methods, over the attributes its constructor sets."""

    model_path: Path
    plan: MegatronPlan
    shape: ModelShape | None
    built: Built
    chunks: list[torch.nn.Module]
    optimizer: Any

    def _sync_params(self) -> None:
        """With `overlap_param_gather` the model holds the last step's weights only once the
        pending parameter all-gathers ran."""
        if self.plan.ddp.get("overlap_param_gather"):
            for chunk in self.chunks:
                chunk.start_param_sync(force_sync=True)

    def export(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._sync_params()
        if self.built.bridge is not None:
            return export_with_bridge(self.built.bridge, self.chunks)
        return export_hf(self.chunks, self.shape, self.built.te, self.built.layout)

    def load_hf(self, named: dict[str, torch.Tensor]) -> None:
        """Load full HF-named tensors (a checkpoint's model) into this rank's shards."""
        from megatron.core import parallel_state as ps

        if self.built.bridge is not None:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                save_hf(iter(named.items()), self.model_path, Path(tmp))
                self.built.bridge.load_hf_weights(self.chunks, hf_path=tmp)
        else:
            stage = self.built.layout[ps.get_pipeline_model_parallel_rank()]
            for chunk, (offset, _) in zip(self.chunks, stage, strict=True):
                load_hf_into(chunk, named.__getitem__, self.shape, self.built.te, offset)
        self.optimizer.reload_model_params()  # refresh the fp32 main copies from the model

    def optimizer_layout(self) -> dict[str, Any]:
        """The parallel layout this rank's optimizer state belongs to."""
        from asyncrl.learner.megatron.optim_state import parallel_layout

        distributed = bool(self.plan.ddp.get("use_distributed_optimizer"))
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return parallel_layout(self.plan.parallel, world, distributed)

    def optimizer_state(self) -> list[dict[str, Any]]:
        """This rank's optimizer state (its shard's), on the CPU."""
        from asyncrl.learner.megatron.optim_state import rank_state

        return rank_state(self.optimizer)

    def load_optimizer_state(self, state: list[dict[str, Any]]) -> None:
        """Restore `optimizer_state` of this rank (after the weights: it carries the fp32 main
        parameters, more exact than the bf16 model's)."""
        from asyncrl.learner.megatron.optim_state import load_rank_state

        load_rank_state(self.optimizer, state)

    def save_sharded(self, path: str, optimizer: bool) -> None:
        """This rank's shards of the model (and `optimizer` state) into the shared directory
        `path`, by Megatron's distributed checkpointing (`dist_ckpt`; every rank calls it)."""
        from asyncrl.learner.megatron import dist_ckpt

        self._sync_params()
        dist_ckpt.save(self.chunks, self.optimizer, path, optimizer)

    def load_sharded(self, path: str, optimizer: bool) -> None:
        """This rank's pieces of a `save_sharded` directory written by any layout."""
        from asyncrl.learner.megatron import dist_ckpt

        dist_ckpt.load(self.chunks, self.optimizer, path, optimizer)

"""The torch learner's weights and state (`TorchLearnerState`, which `TorchLearner` extends):
full tensors for the engines' weight sync, the HF export, and the checkpoint state a resume
needs, of any rank count (FSDP2 shards through `asyncrl.learner.torch.fsdp`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from asyncrl.algo.kl import FixedKLController
from asyncrl.config.schema import WorkerConfig
from asyncrl.learner import lora
from asyncrl.learner.critic import Critic
from asyncrl.learner.reference import ReferenceSpec
from asyncrl.learner.torch import critic as torch_critic
from asyncrl.learner.torch import fsdp
from asyncrl.moe import checkpoint_tensors


class TorchLearnerState:
    """`TorchLearner`'s weights and state methods, over the attributes its constructor sets."""

    model: torch.nn.Module
    reference: torch.nn.Module | None
    reference_spec: ReferenceSpec | None
    lora: bool
    sync_dtype: torch.dtype | None
    device: str
    rank: int
    world_size: int
    train: WorkerConfig
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    critic: Critic | None
    kl_ctrl: FixedKLController | None
    version: int

    def weights_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under the checkpoint's HF names (fused experts split per expert:
        `moe.checkpoint_tensors`; with LoRA: the adapter merged in). Sharded: one
        all-gather per tensor, every rank in this order (distributed.py drains them)."""
        if self.lora:
            return checkpoint_tensors(lora.merged_tensors(self.model, self.sync_dtype))
        return checkpoint_tensors(fsdp.full_tensors(self.model, self.sync_dtype))

    @property
    def sync_device(self) -> torch.device:
        """This rank's device, where `weights_for_sync` yields (see `Learner.sync_device`)."""
        return torch.device(self.device)

    def adapter_for_sync(self) -> Iterator[tuple[str, torch.Tensor]] | None:
        """Only the LoRA adapter (`asyncrl.learner.lora.adapter_tensors`); None without LoRA."""
        return lora.adapter_tensors(self.model) if self.lora else None

    def save_pretrained(self, path: str | Path | None) -> None:
        """HF export; with LoRA the merged model plus the PEFT adapter in `path/adapter`.
        Sharded, every rank calls it (the gathers) and rank 0 writes."""
        out = path if self.rank == 0 else None
        if self.lora:
            fsdp.save_full(self.model.get_base_model(), self.weights_for_sync(), out)
            adapter = lora.whole_adapter(self.model)  # every rank: the adapter's gathers
            if out is not None:
                self.model.save_pretrained(Path(out) / "adapter", state_dict=adapter)
        elif fsdp.sharded(self.world_size):  # gathered tensor by tensor
            fsdp.save_full(self.model, self.weights_for_sync(), out)
        else:
            self.model.save_pretrained(path)

    def pretrained_snapshot(self) -> Callable[[Path], None] | None:
        """The HF export's tensors copied now, written by the returned call (async checkpoint
        saves); None with LoRA (`save_pretrained` exports the adapter too, at once)."""
        return None if self.lora else fsdp.pretrained_snapshot(self.model, self.weights_for_sync())

    def close(self) -> None:
        """Nothing to release: the model lives in this process."""

    def _modules(self) -> dict[str, torch.nn.Module]:
        """Checkpointed modules: the policy, the frozen initial actor (a configured one reloads)."""
        frozen = self.reference is not None and self.reference_spec is None and not self.lora
        return {"model": self.model, **({"reference": self.reference} if frozen else {})}

    def sharded_state(self, optimizer: bool = True) -> dict[str, Any]:
        """The model, optimizer and frozen reference for DCP (each rank its shards)."""
        state = fsdp.dcp_state(self._modules(), self.optimizer if optimizer else None)
        if self.critic is not None:  # its own part: its model and optimizer, sharded alike
            state[torch_critic.DCP_KEY] = torch_critic.dcp_state(self.critic, optimizer)
        return state

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs; sharded, model/optimizer/reference are in `sharded_state`."""
        return {
            **fsdp.model_state(self._modules(), self.optimizer, self.lora, self.world_size),
            "lora": self.lora,
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "critic": self.critic.state_dict() if self.critic is not None else None,
            "kl_ctrl": self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` of any rank count (a sharded one reads `state["sharded_dir"]`)."""
        rank = self.train.model_args.lora_rank
        fsdp.load_model_state(self._modules(), self.optimizer, state, rank, self.world_size)
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        # A checkpoint without them (saved before the critic or KL-in-reward was configured)
        # leaves the fresh critic and the initial coefficient.
        if self.critic is not None and state.get("critic") is not None:
            torch_critic.load_state(self.critic, state["critic"], state.get("sharded_dir"))
        if self.kl_ctrl is not None and state.get("kl_ctrl") is not None:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.version = int(state.get("version", self.version))

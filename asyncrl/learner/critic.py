"""The critic (PPO's value model) as every learner backend uses it: `Critic` and its torch form.

A critic is the policy's architecture (its transformer trunk, no LM head) with a scalar value
head: `V(s_t)` for every response token t, read from the hidden state that predicts token t
(position P - 1 + t of `[prompt (P) | response (R)]`, the same slice as the logits; verl's
`values[:, -R - 1 : -1]`). The learner computes the values on the batch it takes (as fresh as
the learner, not as stale as the rollout), feeds them to GAE, and trains the critic on that
batch with verl's clipped value loss:

    vf_loss = 0.5 · agg(max((V - G)², (clip(V, V_old ± cliprange_value) - G)²))

(`compute_value_loss`; `agg` is `actor.loss_agg_mode`, as verl's critic defaults to it).

Settings a verl or ROLL user looks for, and where they live here:
- the model: `critic.model_args.model_name_or_path` (empty: the actor's own model directory,
  the embedded one included), `critic.model_args.dtype` (null: fp32, like the actor);
- the optimizer: `critic.training_args` (learning_rate, weight_decay, max_grad_norm, warmup and
  schedule; per_device_train_batch_size is the micro-batch), the kind and betas of `actor.optim`;
- epochs and mini-batches: the actor's (`actor.ppo_epochs`, `ppo_mini_batch_size`, `shuffle`),
  verl's critic defaults, or ROLL's global batch from `critic.training_args`
  (`asyncrl.config.plan.step_size`); value passes `critic.infer_batch_size` rows at a time;
- `algorithm.cliprange_value` (verl `critic.cliprange_value`), `algorithm.critic_warmup`
  (verl `trainer.critic_warmup`: the learner skips the actor update for the first N steps).

The value head starts at zero (weights and bias), so an untrained critic predicts 0 and GAE
starts from plain discounted returns rather than from random-head noise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from asyncrl.algo.agg import agg_loss, masked_mean, masked_sum
from asyncrl.config.plan import mini_batches
from asyncrl.learner import packing
from asyncrl.learner.dtensor import local_value as _full
from asyncrl.learner.reference import vocab_size
from asyncrl.learner.torch.fsdp import gather_rows as _gather_rows
from asyncrl.learner.torch.fsdp import set_gradient_sync as _set_gradient_sync

Batch = dict[str, torch.Tensor]


class CriticConfigError(ValueError):
    """A `critic:` section the learner cannot honour; one line naming the key."""


class Critic(Protocol):
    """What a learner needs of its value model (torch here; Megatron implements the same)."""

    def values(self, data: Batch) -> torch.Tensor:
        """[B, R] float32 V(s_t) of every response token of the collated batch, no gradient."""

    def update(
        self, data: Batch, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, float]:
        """Train on the batch: `values` are the ones GAE used (the clip anchor), `returns` its
        targets, `mask` the valid tokens; returns the `critic/*` metrics."""

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and scheduler state (a checkpoint saves it with the learner)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""


@dataclass(frozen=True)
class CriticSettings:
    """The critic's loss and batching, from its config sections (see the module docstring)."""

    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    ppo_epochs: int = 1
    mini_batch_size: int | None = None  # sequences per optimizer step; None: the whole batch
    micro_batch_size: int = 16
    infer_batch_size: int = 4
    max_grad_norm: float = 1.0  # 0: no clipping
    shuffle: bool = False
    pack_budget: int | None = None  # actor.use_dynamic_bsz: packed passes of this many tokens


def critic_model_path(model_name_or_path: str, actor_path: str | Path) -> Path:
    """The critic's HF model directory: its own, else the actor's (already resolved, so the
    embedded model resolves exactly as the actor's does). It scores the actor's token ids, so
    its vocabulary size must equal the actor's: checked here, before any weight loads."""
    path = Path(model_name_or_path or actor_path)
    sizes = [
        vocab_size(p, role, CriticConfigError)
        for p, role in ((Path(actor_path), "actor_train"), (path, "critic"))
    ]
    if sizes[0] != sizes[1]:
        raise CriticConfigError(
            f"critic.model_args.model_name_or_path {path} has vocab_size {sizes[1]} but the "
            f"actor ({actor_path}) has {sizes[0]}: the critic must share the actor's tokenizer"
        )
    return path


# ------------------------------------------------------------------------------ the math
def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's `compute_value_loss`: (0.5 · agg of the clipped squared error, the fraction of
    valid tokens where the clipped error is the larger). `num_tokens`/`num_seqs` are the
    mini-batch's, so micro-batch losses sum to the mini-batch loss (`agg_loss`)."""
    # The prediction itself clamped (verl's `clip_by_value`): inside the range it is `vpreds`
    # bit for bit, so the clip fraction counts clipping only (`values + clamp(vpreds - values)`
    # is an ulp off for many pairs that straddle zero, and counted that rounding).
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    err, err_clipped = (vpreds - returns).square(), (clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(err, err_clipped), mask, loss_agg_mode,
                          num_tokens=num_tokens, num_seqs=num_seqs)  # fmt: skip
    clipfrac = masked_mean((err_clipped > err).to(vpreds.dtype), mask)
    return loss, clipfrac.detach()


@torch.no_grad()
def value_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict:
    """verl's data metrics of a critic: `critic/vf_explained_var` = 1 - Var(G - V) / Var(G)
    over the valid tokens (1: V explains the returns; 0: no better than their mean) and the
    mean value; 0.0 each when no token is valid."""
    valid = mask > 0
    if int(valid.sum()) < 2:
        return {"critic/vf_explained_var": 0.0, "critic/values_mean": 0.0}
    g, v = returns[valid].double(), values[valid].double()
    explained = 1.0 - torch.var(g - v) / (torch.var(g) + 1e-5)
    return {"critic/vf_explained_var": float(explained), "critic/values_mean": float(v.mean())}


# ------------------------------------------------------------------------------ torch critic
class ValueModel(torch.nn.Module):
    """A transformer trunk (hidden states out, e.g. `AutoModel`) and a zero-initialised scalar
    head, in float32 whatever the trunk's dtype."""

    def __init__(self, trunk: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.trunk = trunk
        self.value_head = torch.nn.Linear(hidden_size, 1, dtype=torch.float32)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, data: Batch, packed: bool = False) -> torch.Tensor:
        """[B, R] values of the response tokens' states (see the module docstring); `packed`:
        from one forward of the rows' real tokens (`packing.packed_hidden_states`)."""
        # .clone(): not a view of the head's output, which FSDP2's backward hook must not be
        # (an in-place op on a view would skip it; it warns on every sharded forward)
        if packed:
            hidden = packing.packed_hidden_states(self.trunk, data)
            return self.value_head(hidden.float()).squeeze(-1).clone()
        resp_len = data["response_mask"].shape[1]
        prompt_len = data["input_ids"].shape[1] - resp_len
        hidden = self.trunk(
            input_ids=data["input_ids"],
            attention_mask=data["attention_mask"],
            position_ids=data["position_ids"],
            use_cache=False,
        ).last_hidden_state[:, prompt_len - 1 : prompt_len - 1 + resp_len]
        return self.value_head(hidden.float()).squeeze(-1).clone()


class TorchCritic:
    """`Critic` over a `ValueModel` with its own optimizer and learning-rate schedule. With
    `world_size` > 1 the model is FSDP2-sharded (`asyncrl.learner.torch.critic`) and every rank
    is handed the whole batch: each scores and trains on its own rows (row r on rank r % W),
    running as many forwards as every other rank (each is a collective)."""

    def __init__(
        self,
        model: ValueModel,
        optimizer: torch.optim.Optimizer,
        lr_lambda: Callable[[int], float],
        settings: CriticSettings,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.model, self.optimizer, self.settings = model, optimizer, settings
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        self.updates = 0  # critic updates so far: seeds each update's shuffle
        self.rank, self.world_size = rank, world_size

    @torch.no_grad()
    def values(self, data: Batch) -> torch.Tensor:
        """The whole batch's values on every rank: each rank its rows, then gathered."""
        self.model.eval()
        rows, size = data["input_ids"].shape[0], self.settings.infer_batch_size
        mine = torch.arange(self.rank, rows, self.world_size)
        out = torch.zeros_like(data["response_mask"][mine], dtype=torch.float32)
        passes = self._passes(data, mine, size)
        for i in range(self._pass_count(len(passes))):
            if i >= len(passes):  # out of rows: a forward to match the other ranks' collectives
                self.model(_rows(data, torch.zeros(1, dtype=torch.long)), self._packed)
                continue
            out[passes[i] // self.world_size] = self.model(_rows(data, passes[i]), self._packed)
        return _gather_rows(out, rows, self.world_size) * data["response_mask"]

    @property
    def _packed(self) -> bool:
        return self.settings.pack_budget is not None

    def _pass_count(self, own: int) -> int:
        """The most passes any rank runs (sharded, every forward is a collective)."""
        return packing.global_max(own, self.world_size > 1)

    def _passes(self, data: Batch, rows: torch.Tensor, size: int) -> list[torch.Tensor]:
        """`rows` in passes of `size` rows, or packed under the token budget; this rank's own
        (`_pass_count` says how many every rank runs)."""
        budget = self.settings.pack_budget
        if budget is None:
            return [rows[i : i + size] for i in range(0, len(rows), size)]
        lengths = packing.real_lengths(data["attention_mask"][rows])
        return [rows[torch.tensor(p, dtype=torch.long)] for p in packing.partition(lengths, budget)]

    def update(
        self, data: Batch, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, float]:
        """Every rank walks the same global mini-batches (same seed) over the whole batch and
        trains on the rows of each that it holds; the metrics are the whole batch's."""
        s, rows = self.settings, data["input_ids"].shape[0]
        gen = torch.Generator().manual_seed(self.updates)
        target = {"values": values.float(), "returns": returns.float(), "mask": mask.float()}
        sums: dict[str, float] = {}
        steps = 0
        self.model.train()
        for _ in range(s.ppo_epochs):
            order = torch.randperm(rows, generator=gen) if s.shuffle else torch.arange(rows)
            for part in mini_batches(rows, s.mini_batch_size):  # the plan's steps
                for key, value in self._mini_batch(
                    data, target, order[part.start : part.stop]
                ).items():
                    sums[key] = sums.get(key, 0.0) + value
                steps += 1
        self.updates += 1
        metrics = {k: v / max(1, steps) for k, v in sums.items()}
        metrics["critic/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def _mini_batch(self, data: Batch, target: Batch, rows: torch.Tensor) -> dict[str, float]:
        """One optimizer step over the global mini-batch `rows` (this rank trains on those it
        holds), accumulated over micro-batches; the loss is normalised over the whole
        mini-batch, so neither the micro-batch split nor the rank count changes it."""
        s, world = self.settings, self.world_size
        self.optimizer.zero_grad(set_to_none=True)
        tokens = target["mask"][rows].sum().clamp(min=1.0)  # every rank holds every row
        passes = self._passes(data, rows[rows % world == self.rank], s.micro_batch_size)
        count = self._pass_count(len(passes))
        sums = torch.zeros(3, dtype=torch.float64)  # vf_loss, vf_clipfrac, vpred_mean
        for i in range(count):
            _set_gradient_sync(self.model, i == count - 1)  # FSDP reduces on the last pass
            idx = passes[i] if i < len(passes) else rows[:1]
            vpreds = self.model(_rows(data, idx), s.pack_budget is not None)
            if i >= len(passes):  # out of rows: a zero-loss pass matches the collectives
                (vpreds.sum() * 0.0).backward()
                continue
            mask = target["mask"][idx]
            loss, clipfrac = value_loss(
                vpreds, target["returns"][idx], target["values"][idx], mask,
                s.cliprange_value, s.loss_agg_mode, num_tokens=tokens, num_seqs=len(rows),
            )  # fmt: skip
            (loss * world).backward()  # FSDP averages gradients over the ranks
            share = float(mask.sum() / tokens)  # token-weighted, like verl's masked means
            sums += torch.tensor([float(loss.detach()), float(clipfrac) * share,
                                  float(masked_sum(vpreds.detach(), mask) / tokens)],
                                 dtype=torch.float64)  # fmt: skip
        if world > 1:  # each rank summed its rows' parts: the mini-batch's are their sum
            torch.distributed.all_reduce(sums)
        norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), s.max_grad_norm if s.max_grad_norm > 0 else float("inf")
        )
        norm = _full(norm)  # sharded: the global norm over every rank's shards
        if torch.isfinite(norm):  # a non-finite gradient skips the step, as the actor's does
            self.optimizer.step()
        self.scheduler.step()
        keys = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean")
        return {**dict(zip(keys, sums.tolist(), strict=True)), "critic/grad_norm": float(norm)}

    def state_dict(self) -> dict[str, Any]:
        """Sharded: "sharded" markers for the model and optimizer, whose shards a checkpoint
        writes with the learner's (`asyncrl.learner.torch.critic.dcp_state`)."""
        sharded = self.world_size > 1
        return {
            "model": "sharded" if sharded else self.model.state_dict(),
            "optimizer": "sharded" if sharded else self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A one-process state (whole tensors) into a one-process critic; the other cases:
        `asyncrl.learner.torch.critic.load_state`."""
        self.model.load_state_dict(state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.load_schedule(state)

    def load_schedule(self, state: dict[str, Any]) -> None:
        """The scheduler and update count of `state` (any rank count saved them alike)."""
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        self.updates = int(state.get("updates", self.updates))


def _rows(data: Batch, rows: torch.Tensor) -> Batch:
    return {k: data[k][rows] for k in ("input_ids", "attention_mask", "position_ids",
                                       "response_mask")}  # fmt: skip

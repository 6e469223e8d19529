"""The plain-PyTorch learner (`fsdp2_train`): the CPU default, also runs on one CUDA device.

One `step` = one rollout batch: recompute the proximal logprobs (decoupled; from the training
forward itself when that is provably the proximal policy, `prox_from_training_forward`) or take
the rollout ones (bypass) → rollout IS weights, rejection mask and mismatch metrics → the
batch-level advantages on the whole batch before any row is sharded (REINFORCE++; gae with the
critic's fresh values, `asyncrl.learner.critic`; token rewards minus beta · KL with
use_kl_in_reward) → the critic's update → `ppo_epochs` passes of mini-batches, each one
optimizer step accumulated over micro-batches (none in the first `critic_warmup` steps) →
version += 1 (every step, so admission opens per version even while the actor waits).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from asyncrl.algo.advantages import outcome_token_rewards
from asyncrl.algo.importance import select_old_log_prob
from asyncrl.algo.losses import get_policy_loss
from asyncrl.config.plan import mini_batches, step_size
from asyncrl.config.schema import ActorConfig, AlgorithmConfig, WorkerConfig
from asyncrl.learner import lag_metrics, packing, routing
from asyncrl.learner import logprobs as lp
from asyncrl.learner import objective as obj
from asyncrl.learner.collate import collate
from asyncrl.learner.compile import maybe_compile
from asyncrl.learner.critic import Critic, value_metrics
from asyncrl.learner.reference import reference_spec
from asyncrl.learner.torch import build, fsdp
from asyncrl.learner.torch import critic as torch_critic
from asyncrl.learner.torch.policy import load_policy, load_reference
from asyncrl.learner.torch.state import TorchLearnerState
from asyncrl.types import TrajectoryGroup


class TorchLearner(TorchLearnerState):
    """`Learner` over a transformers causal LM. Receives only its own sub-configs:
    `actor_train` (`train`), `actor`, `algorithm`, `reference` (the KL reference policy's
    section; None: a frozen copy of the initial actor, see `asyncrl.learner.reference`) and
    `critic` (the value model's section; None: no critic). `total_steps`: the actor's optimizer
    steps over the run, its schedule's length (`BatchPlan.actor_optimizer_steps`);
    `critic_total_steps` the critic's (None: `total_steps`). Its weights and state methods
    (weight sync, HF export, checkpoint state) are `TorchLearnerState`'s."""

    def __init__(
        self,
        model_path: str | Path,
        train: WorkerConfig,
        actor: ActorConfig,
        algorithm: AlgorithmConfig,
        temperature: float,
        total_steps: int,
        device: str = "cpu",
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        reference: WorkerConfig | None = None,
        critic: WorkerConfig | None = None,
        critic_total_steps: int | None = None,
    ) -> None:
        from asyncrl.data.tokenizer import model_tokenizer

        # Before the model loads: a gae run without a critic fails at once
        obj.check_learner_side(algorithm, critic is not None, world_size)
        self.rollout_is = obj.rollout_is_settings(algorithm)  # likewise a bad IS setting
        # The plan's step size: the steps taken are those the schedule is sized for (or fail now)
        self.step_size = step_size(actor, train.training_args, world_size)
        # Likewise a reference section that cannot be honoured (vocabulary, devices).
        uses_ref = actor.use_kl_loss or algorithm.use_kl_in_reward
        self.reference_spec = reference_spec(reference, model_path, train, uses_ref)
        torch.manual_seed(seed)
        self.train, self.actor, self.algorithm = train, actor, algorithm
        self.temperature, self.device, self.version = temperature, device, 0
        self.rank, self.world_size = rank, world_size
        policy = load_policy(model_path, train.model_args, device, world_size, actor)
        self.model, self.sync_dtype, self.lora = policy.model, policy.sync_dtype, policy.lora
        # the tokenizer the driver's prompts are encoded with (transformers 5's AutoTokenizer
        # would rebuild the embedded model's as a byte-level Qwen2Tokenizer: ~1 s of CPU)
        tokenizer = model_tokenizer(model_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.reference = load_reference(self.reference_spec, policy, device) if uses_ref else None
        spec = self.reference_spec
        self.reference_batch_size = spec.infer_batch_size if spec else train.infer_batch_size
        # > 1 rank: FSDP2 shards parameters, gradients and optimizer state (and the reference)
        # over the default process group, which must exist (asyncrl.learner.torch.distributed).
        self.train_model: torch.nn.Module = self.model
        if fsdp.sharded(world_size):
            fsdp.shard_learner(self.model, self.reference, train, device, policy.dtype)
        maybe_compile(self.model, actor.use_torch_compile)  # after sharding (FSDP2's order)
        # After the reference's copy (it routes itself): the training forward's lean shared-prompt
        # logits, or the policy's routing replay (r3: the engines' routes; r2: its own).
        self.logits_fn, self.route_tap = build.forward_path(self.model, train, actor, world_size)
        self.optimizer, self.scheduler = build.optimization(self.model, train, actor, total_steps)
        self.loss_params = obj.loss_params(actor)
        self.loss_fn = get_policy_loss(actor.policy_loss.loss_mode)
        self.critic: Critic | None = None
        if critic is not None:
            critic_steps = total_steps if critic_total_steps is None else critic_total_steps
            self.critic = torch_critic.build_critic(critic, model_path, actor, algorithm,
                                                    device, critic_steps, rank, world_size)  # fmt: skip
        self.kl_ctrl = obj.kl_controller(algorithm)  # None unless use_kl_in_reward
        self.stochastic_forward = lp.has_dropout(self.model)
        # the dtypes the trained (and reference) weights are held in: tensors per dtype
        self.dtype_metrics = build.dtype_metrics(self.model, self.reference)

    # -- the update --------------------------------------------------------------------------
    def step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        start = time.perf_counter()
        # Canonical order: the batch (and so every float sum) does not depend on arrival order.
        groups = sorted(groups, key=lambda g: g.group_id)
        data = collate(groups, self.pad_id).to_torch(self.device)
        data["response_mask"] = data["response_mask"].float()
        total_rows = data["input_ids"].shape[0]
        pad = 1.0 - float(data["attention_mask"].float().mean())
        warmup = self.critic is not None and self.version < self.algorithm.critic_warmup
        reuse = not warmup and obj.prox_from_training_forward(
            self.algorithm, self.actor, total_rows, self.stochastic_forward, self.step_size
        )
        if self.world_size > 1:  # batch-level advantages see every row, then each its shard
            data, prep, metrics, adv_metrics = self._sharded_advantages(data, total_rows, reuse)
        else:  # one process holds the whole batch: KL-in-reward and GAE need old/ref/values
            prep, metrics = self._prepare(data, reuse)
            adv_metrics = self._advantages(data, prep)
        if not warmup:  # critic_warmup: the first steps train the critic only
            metrics.update(self._optimise(data, prep, total_rows))
        if reuse:  # the IS metrics of the whole batch, from what the training forward filled in
            metrics.update(self._correct(prep["prox"], data["rollout_logprobs"], data, True)[2])
        metrics = fsdp.mean_over_ranks(metrics, self.world_size)
        self.version += 1
        metrics.update(
            {
                **adv_metrics,
                **self.dtype_metrics,
                "learner/step_seconds": time.perf_counter() - start,
                "learner/lr": self.scheduler.get_last_lr()[0],
                "learner/tokens": float(data["response_mask"].sum()),
                "learner/sequences": float(data["response_mask"].shape[0]),
                # share of the training forwards' tokens that are padding (0: packed)
                "learner/padding_frac": 0.0 if self.actor.use_dynamic_bsz else pad,
                **routing.replay_metrics(self.route_tap),
            }
        )
        return metrics

    def _sharded_advantages(
        self, data: dict[str, torch.Tensor], total_rows: int, reuse: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, float], dict[str, float]]:
        """Advantages over ranks: each rank scores its own rows (row r on rank r % world: old
        and reference logprobs, the critic's values, in sharded forwards); with KL-in-reward
        the whole batch's logprobs are gathered on every rank, and every rank computes the same
        penalised rewards, batch-level advantages and KL-controller update, and trains the
        critic on its rows of the whole batch (`TorchCritic.update`); then it keeps its rows.
        Returns (its rows, their prep, IS metrics, advantage and critic metrics)."""
        rows = fsdp.own_rows(total_rows, self.rank, self.world_size)
        shard = lp.select_rows(data, rows)
        prep, metrics = self._prepare(shard, reuse)  # reuse is never on with KL-in-reward
        whole = {}
        if self.kl_ctrl is not None:  # only KL-in-reward reads the logprobs of the whole batch
            whole = {
                k: fsdp.gather_rows(prep[k], total_rows, self.world_size)
                for k in ("old", "ref_all")
            }
        adv_metrics = self._advantages(data, whole)
        shard["advantages"] = data["advantages"][rows]
        return shard, prep, metrics, adv_metrics

    def _correct(
        self,
        old: torch.Tensor,
        rollout: torch.Tensor,
        data: dict[str, torch.Tensor],
        lags: bool = False,
        metrics: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
        """`correct` (IS weights, rejection-filtered mask, mismatch metrics) of these rows.
        `lags`: with the IS weights' ESS by staleness (`is/ess_by_lag/<k>`) — only on the
        step's whole-batch (or, sharded, whole-shard) call: with several ranks it is a
        collective every rank makes. `metrics` False: the weights alone (a micro-batch's)."""
        loss_mode, mask = self.actor.policy_loss.loss_mode, data["response_mask"]
        by_lag = lag_metrics.sequence_lags(data["versions"], self.version) if lags else None
        return obj.correct(self.algorithm, self.rollout_is, loss_mode, old, rollout, mask,
                           by_lag, all_ranks=self.world_size > 1, metrics=metrics)  # fmt: skip

    @torch.no_grad()
    def _prepare(
        self, data: dict[str, torch.Tensor], reuse: bool = False
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """Old/reference logprobs, IS weights and the (rejection-filtered) loss mask. `reuse`:
        the training forward fills `prep["prox"]` and corrects each micro-batch (`_micro_loss`);
        else they are recomputed in token-budget forwards (`budget_logprobs`; with
        use_dynamic_bsz packed ones, as the reference's: `lp.packed_logprobs`)."""
        alg, rollout, pack = self.algorithm, data["rollout_logprobs"], lp.pack_budget(self.actor)
        if not reuse or self.reference is not None:  # forwards below (a LoRA reference: this one)
            self.model.eval()
        old, weights, mask, metrics = None, None, data["response_mask"], {}
        if not reuse:
            recomputed = None
            if alg.correction_mode == "decoupled":
                budget = self.train.infer_batch_size * data["input_ids"].shape[1]
                routes = None  # r2: this pass's routes, which the update's forwards replay
                if self.actor.router_replay == "r2":
                    rows, width = data["input_ids"].shape
                    routes = routing.empty_routes(self.model, rows, width, self.device)
                recomputed = lp.budget_logprobs(
                    self.model, data, self.temperature, budget, pack, routes
                )
                if routes is not None:
                    data["routes"] = routes
            old = select_old_log_prob(alg.correction_mode, rollout, recomputed)
            weights, mask, metrics = self._correct(old, rollout, data, lags=True)
        ref = None
        if self.reference is not None:
            ref = lp.batched_logprobs(
                self.reference, data, self.temperature, self.reference_batch_size, pack
            )
        # "ref" is what the KL loss reads (only with use_kl_loss); KL-in-reward reads "ref_all".
        loss_ref = ref if self.actor.use_kl_loss else None
        prep = {"old": old, "weights": weights, "mask": mask, "ref": loss_ref, "ref_all": ref}
        prep["prox"] = torch.zeros_like(rollout) if reuse else None
        return prep, metrics

    def _advantages(self, data: dict[str, torch.Tensor], prep: dict[str, Any]) -> dict[str, float]:
        """Set `data["advantages"]` for the whole batch: token rewards (each row's reward on its
        last valid token, minus beta · KL with use_kl_in_reward), the critic's values (fresh:
        this batch, the current critic), the estimator; then the critic's update on the batch.
        The critic trains on the collated loss mask, as GAE saw it (not rejection's)."""
        alg, mask = self.algorithm, data["response_mask"]
        rewards, metrics = None, {}
        if self.kl_ctrl is not None:
            rewards = outcome_token_rewards(data["rewards"].to(torch.float64), mask > 0)
            rewards, metrics = obj.kl_reward(alg, self.kl_ctrl, rewards, prep["old"],
                                             prep["ref_all"], mask)  # fmt: skip
        values = self.critic.values(data) if self.critic is not None else None
        data["advantages"], returns = obj.advantages_and_returns(alg, data, rewards, values)
        metrics.update(obj.advantage_metrics(data["advantages"], mask))
        if self.critic is not None and values is not None:
            metrics.update(value_metrics(values, returns, mask))
            metrics.update(self.critic.update(data, values, returns, mask))
        return metrics

    def _optimise(
        self, data: dict[str, torch.Tensor], prep: dict[str, Any], total_rows: int
    ) -> dict[str, float]:
        """`ppo_epochs` passes of global mini-batches (`plan.mini_batches`: the steps the plan
        counts); every rank walks the same global order (same seed) and trains on the rows of
        each mini-batch that it holds."""
        gen = torch.Generator().manual_seed(self.version)
        sums: dict[str, float] = {}
        updates = 0
        if not self.model.training:  # only `_prepare` leaves it: each call walks every module
            self.model.train()
        for _ in range(self.actor.ppo_epochs):
            order = torch.arange(total_rows)
            if self.actor.shuffle:
                order = torch.randperm(total_rows, generator=gen)
            for part in mini_batches(total_rows, self.step_size):
                rows = order[part.start : part.stop]
                local = rows[rows % self.world_size == self.rank] // self.world_size
                for key, value in self._mini_batch(data, prep, local, len(rows)).items():
                    sums[key] = sums.get(key, 0.0) + value
                updates += 1
        return {k: v / max(1, updates) for k, v in sums.items()}

    def _mini_batch(
        self,
        data: dict[str, torch.Tensor],
        prep: dict[str, Any],
        rows: torch.Tensor,
        global_rows: int,
    ) -> dict[str, float]:
        """One optimizer step over `rows` (this rank's part of a mini-batch of `global_rows`),
        accumulated over micro-batches of the per-device size; FSDP syncs on the last one."""
        micro = self.train.training_args.per_device_train_batch_size
        self.optimizer.zero_grad(set_to_none=True)
        tokens = prep["mask"][rows].sum()
        if self.world_size > 1:
            torch.distributed.all_reduce(tokens)
        totals = {"tokens": tokens.clamp(min=1.0), "seqs": float(global_rows)}
        chunks = lp.train_micro_batches(
            data["attention_mask"], rows, micro, self.actor, self.world_size > 1
        )
        sums: dict[str, float] = {}
        # Sharded, every forward/backward is a collective: all ranks run as many passes (the
        # most any rank has), a rank out of rows runs zero-loss ones; gradients reduce on the last.
        passes = packing.global_max(len(chunks), self.world_size > 1)
        for i in range(passes):
            fsdp.set_gradient_sync(self.train_model, i == passes - 1)
            if i >= len(chunks):
                loss, _, _ = self._micro_loss(data, prep, torch.zeros(1, dtype=torch.long), totals)
                (loss * 0.0).backward()
                continue
            loss, metrics, share = self._micro_loss(data, prep, chunks[i], totals)
            # FSDP averages gradients over ranks; the loss is normalised globally already.
            (loss * self.world_size).backward()
            # Metrics weigh like the loss (tokens or sequences of the whole mini-batch, over all
            # ranks), so they do not depend on how rows are split into micro-batches or ranks;
            # `fsdp.mean_over_ranks` divides by the world size again.
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value * share * self.world_size
        max_norm = self.train.training_args.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), max_norm if max_norm > 0 else float("inf")
        )
        norm = fsdp.local_value(norm)  # sharded: the global norm over every rank's shards
        if torch.isfinite(norm):
            self.optimizer.step()
        sums["actor/grad_norm"] = float(norm)
        self.scheduler.step()
        return sums

    def _micro_loss(
        self,
        data: dict[str, torch.Tensor],
        prep: dict[str, Any],
        idx: torch.Tensor,
        totals: dict[str, Any],
    ) -> tuple[torch.Tensor, dict[str, float], float]:
        """(loss scaled by its share of the mini-batch, metrics, that share)."""
        actor = self.actor
        micro = lp.select_rows(data, idx)
        mask = prep["mask"][idx]
        logp, entropy = lp.token_logprobs(
            self.train_model, micro, self.temperature, True, actor.use_dynamic_bsz, self.logits_fn
        )
        if actor.entropy_coeff == 0 and entropy is not None:
            # Only the metric needs it: detached, its graph (a [B, R, V] softmax) is freed now.
            entropy = entropy.detach()
        rows = {k: prep[k][idx] if prep[k] is not None else None for k in ("old", "weights", "ref")}
        rows.update(mask=mask, advantages=micro["advantages"])
        if prep["prox"] is not None:  # one optimizer step: this forward IS the proximal policy
            rows["old"] = prep["prox"][idx] = logp.detach()
            # metrics: the step's whole-batch call reports them, from every micro-batch's prox
            old, behav = rows["old"], micro["rollout_logprobs"]
            rows["weights"] = self._correct(old, behav, micro, metrics=False)[0]
        rows["rollout_logprobs"] = micro["rollout_logprobs"]
        loss, metrics = obj.objective(actor, self.loss_fn, self.loss_params, logp, entropy, rows)
        # Aggregate over the whole mini-batch, not per micro-batch (see common.micro_share).
        share = obj.micro_share(actor.loss_agg_mode, mask, len(idx), totals)
        return loss * share, metrics, float(share)

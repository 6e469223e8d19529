"""One rank of the Megatron learner (SPMD: every rank runs the same calls in the same order).

Build: torch.distributed -> `parallel_state.initialize_model_parallel` -> TransformerConfig ->
GPTModel on Megatron's local layer spec (or Transformer Engine's) with HF weights loaded
shard by shard -> Float16Module (bf16/fp16) -> DistributedDataParallel -> Megatron optimizer.
With Megatron-Bridge installed (and `use_bridge` not false) `AutoBridge` builds and converts.

Step: the same as the torch learner (`asyncrl.learner.objective`), with the logprobs of the
response tokens from the last stage's hidden states, projected to the vocabulary shard at the
response positions only, a chunk of tokens at a time (`head`), and Megatron's pipeline schedule
driving micro-batches. Every rank collates the whole batch and computes its batch-level
advantages (REINFORCE++) before rows are split over data-parallel ranks; the proximal (and
reference) logprobs of the whole batch are gathered so IS, rejection and batch normalisation
see the batch.

Context parallel: each row is split along the sequence (Megatron's load-balanced 2·CP chunks,
`get_batch_on_this_cp_rank`); each CP rank scores the response tokens it holds and the
[B, R] values are summed over the CP group, so the loss and its aggregation are exactly those
without CP. Virtual pipeline: the model is a list of chunks and Megatron's interleaved
schedule runs them; the micro-batch count is made a multiple of PP (dead micro-batches weigh 0).

The weights and state methods (export, HF load, optimizer state, sharded checkpoints) are
`MegatronWorkerState`'s (`state.py`); the data-parallel collectives are `data_parallel.py`'s.
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import torch

from asyncrl.algo.importance import select_old_log_prob
from asyncrl.algo.losses import get_policy_loss
from asyncrl.config.plan import mini_batches, step_size
from asyncrl.device import DeviceSpec, detect_device, prepare_megatron_imports
from asyncrl.learner.collate import collate
from asyncrl.learner.lag_metrics import sequence_lags
from asyncrl.learner.megatron.args import check_experts, check_options, plan
from asyncrl.learner.megatron.batch import right_align, schedule_micro, shard_rows
from asyncrl.learner.megatron.build import (
    Built,
    bridge_class,
    build_builtin,
    build_with_bridge,
    init_distributed,
    init_parallel,
    wrap,
)
from asyncrl.learner.megatron.compat import split_for_cp_rank
from asyncrl.learner.megatron.data_parallel import dp_ranks, gather_rows, mean_metrics
from asyncrl.learner.megatron.head import head_weight, pass_hidden, response_logprobs
from asyncrl.learner.megatron.logits import token_logprobs
from asyncrl.learner.megatron.name_mapping import ModelShape
from asyncrl.learner.megatron.reference import megatron_reference
from asyncrl.learner.megatron.replay import align_routes, make_replayer, replay_metrics, unalign
from asyncrl.learner.megatron.state import MegatronWorkerState
from asyncrl.learner.objective import (
    advantage_metrics,
    batch_advantages,
    check_estimator,
    correct,
    loss_params,
    lr_factor,
    micro_share,
    objective,
    rollout_is_settings,
)


def require_megatron() -> None:
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "the megatron_train strategy needs megatron-core (pip install 'asyncrl[megatron]'; "
            f"on Ascend also torch-npu and mindspeed): {e}"
        ) from None


class MegatronWorker(MegatronWorkerState):
    def __init__(self, model_path, train, actor, algorithm, temperature, total_steps, seed=0,
                 rank=0, world_size=1, init_method=None, device: DeviceSpec | None = None,
                 local_device=0, reference=None) -> None:  # fmt: skip
        check_estimator(algorithm)  # a gae run fails before any process group or model
        self.rollout_is = rollout_is_settings(algorithm)  # likewise a bad IS setting
        self.device = device or detect_device()
        prepare_megatron_imports(self.device)  # MindSpeed before Megatron, on Ascend
        require_megatron()
        self.sc = dict(train.strategy_args.strategy_config)
        self.auto_bridge = bridge_class(self.sc.get("use_bridge", "auto"))
        # Likewise a reference section the learner cannot honour (see .reference).
        spec = megatron_reference(reference, model_path, train, actor, self.auto_bridge is None)
        self.model_path, self.train, self.actor = Path(model_path), train, actor
        self.algorithm, self.temperature, self.version, self.lr_step = algorithm, temperature, 0, 0
        self.lr_factor = lr_factor(train.training_args, actor.optim, total_steps)
        self.loss_fn = get_policy_loss(actor.policy_loss.loss_mode)
        self.loss_params = loss_params(actor)
        init_distributed(self.device, rank, world_size, init_method, local_device)
        hf = json.loads((self.model_path / "config.json").read_text())
        self.vocab_size = hf["vocab_size"]
        check_options(self.sc)
        check_experts(hf, self.sc, world_size)
        tp = int(self.sc.get("tensor_model_parallel_size") or 1)
        self.shape = None
        if self.auto_bridge is None:
            self.shape = ModelShape.from_hf_config(hf).padded_to(tp)
        rows = self.shape.vocab_rows if self.shape else 0
        self.plan = plan(train, actor.optim, hf, rows, builtin=self.shape is not None)
        init_parallel(self.plan, seed, getattr(init_method, "timeout_s", None))
        # Sequences per optimizer step by the plan's rule (`asyncrl.config.plan`): the steps
        # taken are those the schedule (`lr_factor`) was sized for.
        self.step_size = step_size(actor, train.training_args, dp_ranks()[0])
        self.built = self._build(self.model_path, trainable=True)
        self.reference = None
        if actor.use_kl_loss:  # the reference policy: frozen, the actor's layout and dtype
            ref_path = spec.path if spec is not None else self.model_path
            self.reference = self._build(ref_path, trainable=False).chunks
        self.reference_batch_size = spec.infer_batch_size if spec else train.infer_batch_size
        self.chunks, self.optimizer, self.config = wrap(self.built, self.plan)
        self.replayer, self._watched = None, None  # R3: the policy's routers replay routes
        if actor.router_replay == "r3":
            self.replayer = make_replayer(self.chunks, self.config, hf)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    @property
    def ddp(self) -> torch.nn.Module:
        """The one DDP-wrapped model when there are no virtual pipeline stages (else `chunks`)."""
        if len(self.chunks) != 1:
            raise AttributeError(f"the model has {len(self.chunks)} chunks (virtual pipeline "
                                 "stages): use .chunks")  # fmt: skip
        return self.chunks[0]

    def _build(self, path: Path, trainable: bool) -> Built:
        """The model chunks, the last stage's returning its final hidden states where the
        output layer can be projected at the response positions only (`head.pass_hidden`)."""
        if self.auto_bridge is not None:
            built = build_with_bridge(self.auto_bridge, self.plan, self.sc, path, trainable)
        else:
            built = build_builtin(self.plan, self.shape, path, self.device, trainable)
        pass_hidden(built.chunks)
        return built

    # -- logprobs ---------------------------------------------------------------------------
    def _token_logprobs(self, output: torch.Tensor, weight: torch.Tensor | None, data: dict,
                        idx: torch.Tensor, entropy: bool):  # fmt: skip
        """The response tokens' logprobs (and entropy) from the last stage's `output`: its final
        hidden states projected by `weight` in chunks (`head`), or, where the model returns
        logits (weight None), those."""
        labels, resp = data["labels"][idx], data["resp_index"][idx]
        if weight is not None:
            return response_logprobs(output, weight, labels, resp, self.temperature,
                                     self.vocab_size, entropy)  # fmt: skip
        return token_logprobs(output, labels, resp, self.temperature, self.vocab_size, entropy)

    def _micro(self, rows: torch.Tensor, size: int, filler: torch.Tensor) -> list[tuple]:
        """(rows, live) micro-batches; as many as Megatron's interleaved schedule needs (a
        multiple of the pipeline size) under virtual pipeline stages."""
        multiple = self.config.pipeline_model_parallel_size if len(self.chunks) > 1 else 1
        return schedule_micro(rows, size, filler, multiple)

    def _run(self, model: list, data, micro, loss_of, forward_only: bool) -> list:
        """Megatron's schedule over `micro` ((row indices, live) pairs) on the model chunks;
        loss_of(micro, head weight, output) (see `_token_logprobs`). Every chunk reads the
        micro-batches in the same order."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        replay = self.replayer is not None and model is self.chunks  # not the reference's

        def forward_step(data_iterator, module):
            item = next(data_iterator)
            idx = item[0]
            if replay:  # this micro-batch's rows, for this chunk's routers (None: no routes)
                routes = data.get("aligned_routes")
                self.replayer.set(None if routes is None else routes[idx])
                if self._watched is not None:
                    self._watched.append(idx.cpu())
            out = module(data["tokens"][idx], data["position_ids"][idx], None)
            return out, partial(loss_of, item, head_weight(module))

        iters = [iter(micro) for _ in model]
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iters if len(model) > 1 else iters[0],
            model=model, num_microbatches=len(micro), seq_length=data["seq_length"],
            micro_batch_size=max(len(m[0]) for m in micro), forward_only=forward_only,
        )  # fmt: skip

    @torch.no_grad()
    def _batched_logprobs(self, model: list, data: dict, batch_size: int) -> torch.Tensor | None:
        """Logprobs of every row of the batch (each DP rank scores its shard, `batch_size`
        rows a pass, then gather)."""
        dp, dp_rank, last = dp_ranks()
        rows = data["tokens"].shape[0]
        dev = data["tokens"].device
        mine = shard_rows(rows, dp, dp_rank).to(dev)
        micro = self._micro(mine, batch_size, torch.zeros(1, dtype=torch.long, device=dev))

        def loss_of(item, weight, output):
            lp, _ = self._token_logprobs(output, weight, data, item[0], entropy=False)
            return output.new_zeros(()), {"logprobs": lp, "live": item[1]}

        for chunk in model:
            chunk.eval()
        outs = self._run(model, data, micro, loss_of, forward_only=True)
        part = None
        if last:
            live = [o["logprobs"] for o in outs if o["live"]]
            part = torch.cat(live) if live else outs[0]["logprobs"][:0]
        return gather_rows(part, rows)

    # -- the update --------------------------------------------------------------------------
    def _data(self, groups: list) -> dict[str, torch.Tensor]:
        """The collated batch (canonical group order) plus its right-aligned Megatron layout."""
        groups = sorted(groups, key=lambda g: g.group_id)
        where = torch.cuda.current_device() if self.device.kind == "cuda" else None
        data = collate(groups, self.pad_id).to_torch(where or self.device.torch_device())
        data["response_mask"] = data["response_mask"].float()
        if data["input_ids"].shape[0] < dp_ranks()[0]:
            raise ValueError("the rollout batch has fewer sequences than data-parallel ranks")
        cp = self.config.context_parallel_size
        tp = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
        data.update(right_align(data, self.pad_id, 2 * cp * tp if cp > 1 else tp))
        data["seq_length"] = data["tokens"].shape[1]
        keys: tuple[str, ...] = ("tokens", "position_ids", "labels")
        if self.replayer is not None and "routes" in data:  # laid out as the tokens are
            data["aligned_routes"] = align_routes(data["routes"], data)
            keys += ("aligned_routes",)
        if cp > 1:  # this CP rank's positions, split as Megatron's own training loop splits
            data.update(split_for_cp_rank({k: data[k] for k in keys}))
        return data

    def logprobs(self, groups: list) -> torch.Tensor | None:
        """Per-token logprobs [B, R] under the current policy, rows in group-id order (on the
        last pipeline stage; None on the others)."""
        return self._batched_logprobs(self.chunks, self._data(groups), self.train.infer_batch_size)

    def replayed_routes(self, groups: list) -> torch.Tensor:
        """The experts this rank's routers dispatched each token to in one scoring pass of
        `groups` with routes replayed ([B, P+R, layers * k] in collate's layout, sorted ids per
        layer; -1 at rows of other DP ranks, pads, and tokens not routed to exactly k)."""
        if self.replayer is None or self.config.context_parallel_size > 1:
            raise RuntimeError("replayed_routes needs actor.router_replay: r3 and no CP")
        data = self._data(groups)
        self._watched, self.replayer.watch = [], True
        try:
            self._batched_logprobs(self.chunks, data, self.train.infer_batch_size)
            used = self.replayer.used(data["tokens"].shape[0], data["seq_length"], self._watched)
        finally:
            self._watched, self.replayer.watch = None, False
        return unalign(used.flatten(2), {k: data[k].cpu() for k in ("attention_mask",
                                                                    "response_mask")})  # fmt: skip

    def step(self, groups: list) -> dict[str, float]:
        start = time.perf_counter()
        data = self._data(groups)
        data["advantages"] = batch_advantages(self.algorithm, data)  # whole batch, every rank
        prep, metrics = self._prepare(data)
        metrics.update(self._optimise(data, prep))
        if self.replayer is not None:  # every rank takes part: the counts are summed
            metrics.update(replay_metrics(self.replayer, data["tokens"].device))
        self.version += 1
        metrics.update({
            **advantage_metrics(data["advantages"], data["response_mask"]),
            "learner/step_seconds": time.perf_counter() - start,
            "learner/lr": self.train.training_args.learning_rate * self.lr_factor(self.lr_step),
            "learner/tokens": float(data["response_mask"].sum()),
            "learner/sequences": float(data["response_mask"].shape[0]),
        })  # fmt: skip
        return metrics if dp_ranks()[2] else {}

    def _prepare(self, data: dict) -> tuple[dict | None, dict[str, float]]:
        alg = self.algorithm
        recomputed = None
        if alg.correction_mode == "decoupled":
            recomputed = self._batched_logprobs(self.chunks, data, self.train.infer_batch_size)
        ref = None
        if self.reference is not None:
            ref = self._batched_logprobs(self.reference, data, self.reference_batch_size)
        if not dp_ranks()[2]:
            return None, {}
        rollout, mask = data["rollout_logprobs"], data["response_mask"]
        old = select_old_log_prob(alg.correction_mode, rollout, recomputed)
        lags = sequence_lags(data["versions"], self.version)  # is/ess_by_lag/<k>
        weights, mask, metrics = correct(
            alg, self.rollout_is, self.actor.policy_loss.loss_mode, old, rollout, mask, lags
        )
        return {"old": old, "weights": weights, "mask": mask, "ref": ref}, metrics

    def _optimise(self, data: dict, prep: dict | None) -> dict[str, float]:
        rows = data["tokens"].shape[0]
        gen = torch.Generator().manual_seed(self.version)
        dp, dp_rank, _ = dp_ranks()
        sums: dict[str, float] = {}
        updates = 0
        for _ in range(self.actor.ppo_epochs):
            order = (
                torch.randperm(rows, generator=gen) if self.actor.shuffle else torch.arange(rows)
            )
            for part in mini_batches(rows, self.step_size):  # the plan's steps
                batch = order[part.start : part.stop]
                mine = batch[shard_rows(len(batch), dp, dp_rank)]
                for key, value in self._mini_batch(data, prep, mine, batch).items():
                    sums[key] = sums.get(key, 0.0) + value
                updates += 1
        return {k: v / max(1, updates) for k, v in sums.items()}

    def _mini_batch(self, data, prep, mine: torch.Tensor, batch: torch.Tensor) -> dict[str, float]:
        """One optimizer step: Megatron divides each micro-batch loss by their number and DDP
        averages over DP ranks; the loss is scaled back so the gradient is the mini-batch's.
        (Under CP Megatron also multiplies the loss by CP and DDP averages over DP x CP.)"""
        dp, _, last = dp_ranks()
        dev = data["tokens"].device
        size = self.train.training_args.per_device_train_batch_size
        # A rank with no rows (or too few) runs dead passes: collectives stay matched.
        micro = self._micro(mine.to(dev), size, batch[:1].to(dev))
        totals = None
        if last:
            tokens = prep["mask"][batch.to(dev)].sum().clamp(min=1.0)
            totals = {"tokens": tokens, "seqs": float(len(batch))}
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
            chunk.train()
        self.optimizer.zero_grad()
        loss_of = partial(self._micro_loss, data, prep, totals, len(micro) * dp)
        outs = self._run(self.chunks, data, micro, loss_of, forward_only=False)
        for group in self.optimizer.param_groups:
            group["lr"] = self.train.training_args.learning_rate * self.lr_factor(self.lr_step)
        _, grad_norm, _ = self.optimizer.step()
        self.lr_step += 1
        metrics = mean_metrics(outs) if last else {}
        metrics["actor/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        return metrics

    def _micro_loss(self, data, prep, totals, scale, item, weight, output):
        actor = self.actor
        idx, live = item
        lp, ent = self._token_logprobs(output, weight, data, idx, entropy=True)  # logged each step
        if actor.entropy_coeff == 0:
            ent = ent.detach()  # a metric only: no graph kept for it
        rows = {k: prep[k][idx] if prep[k] is not None else None for k in ("old", "weights", "ref")}
        rows.update(mask=prep["mask"][idx], advantages=data["advantages"][idx])
        rows["rollout_logprobs"] = data["rollout_logprobs"][idx]
        loss, metrics = objective(actor, self.loss_fn, self.loss_params, lp, ent, rows)
        share = micro_share(actor.loss_agg_mode, rows["mask"], len(idx), totals) if live else 0.0
        # A dead micro-batch (no rows of this rank's) weighs nothing, its metrics neither.
        metrics["_share"] = float(share)
        return loss * share * scale, metrics

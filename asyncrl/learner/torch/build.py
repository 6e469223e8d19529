"""The torch learner's training parts, built once its models are loaded (and sharded): the
optimizer and its learning-rate schedule, the training forward's path (the lean shared-prompt
logits or routing replay), and the dtype metrics of the weights it holds."""

from __future__ import annotations

import torch

from asyncrl import moe
from asyncrl.config.schema import ActorConfig, WorkerConfig
from asyncrl.learner import lean, routing
from asyncrl.learner import objective as obj
from asyncrl.learner.logprobs import LogitsFn


def optimization(
    model: torch.nn.Module, train: WorkerConfig, actor: ActorConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer `actor.optim` names over `model`'s trainable parameters, and its schedule
    (warm-up, then decay) over `total_steps` optimizer steps."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = obj.make_optimizer(params, train.training_args, actor.optim)
    factor = obj.lr_factor(train.training_args, actor.optim, total_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def forward_path(
    model: torch.nn.Module, train: WorkerConfig, actor: ActorConfig, world_size: int
) -> tuple[LogitsFn | None, moe.Tap | None]:
    """(the training forward's logits function, the routing tap). Each group's prompt once per
    micro-batch where it may be, in the lean forward where that is taken (`learner/lean.py`);
    None: every row whole. With router_replay r2/r3 the policy's forwards replay routes (r3:
    the engines'; r2: its own), and every row runs whole: the shared-prompt forwards take no
    routes. Call it after the reference's copy is made: the reference routes itself."""
    logits_fn = lean.training_logits_fn(model, train, actor, world_size)
    route_tap = None
    if actor.router_replay in ("r2", "r3"):
        route_tap = routing.enable(model)
        logits_fn = None
    return logits_fn, route_tap


def dtype_metrics(model: torch.nn.Module, reference: torch.nn.Module | None) -> dict[str, float]:
    """The dtypes the trained (and a separate reference's) weights are held in: tensors per
    dtype, as `learner/params_<dtype>` and `learner/reference_params_<dtype>`."""
    metrics = _dtype_counts("learner/params_", model)
    if reference is not None and reference is not model:
        metrics |= _dtype_counts("learner/reference_params_", reference)
    return metrics


def _dtype_counts(prefix: str, model: torch.nn.Module) -> dict[str, float]:
    """`<prefix><torch dtype>`: how many of `model`'s parameter tensors are held in it."""
    counts: dict[str, float] = {}
    for p in model.parameters():
        key = prefix + str(p.dtype).removeprefix("torch.")
        counts[key] = counts.get(key, 0.0) + 1.0
    return counts

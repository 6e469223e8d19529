"""The Megatron worker's data-parallel collectives: where this rank stands, the rows every DP
rank scored gathered back into the batch, and step metrics summed over DP ranks."""

from __future__ import annotations

import torch

from asyncrl.learner.megatron.batch import shard_rows


def dp_ranks() -> tuple[int, int, bool]:
    """(data-parallel size, this rank's DP index, whether it is the last pipeline stage)."""
    from megatron.core import parallel_state as ps

    last = ps.is_pipeline_last_stage()
    return ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), last


def gather_rows(part: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """Concatenate every DP rank's contiguous row shard (last pipeline stage only)."""
    from megatron.core import parallel_state as ps

    dp, _, last = dp_ranks()
    if not last or dp == 1:
        return part
    width = -(-rows // dp)
    padded = torch.zeros(width, *part.shape[1:], dtype=part.dtype, device=part.device)
    padded[: len(part)] = part
    out = torch.empty(dp * width, *part.shape[1:], dtype=part.dtype, device=part.device)
    torch.distributed.all_gather_into_tensor(out, padded, group=ps.get_data_parallel_group())
    keep = [torch.arange(len(shard_rows(rows, dp, r))) + r * width for r in range(dp)]
    return out[torch.cat(keep).to(out.device)]


def mean_metrics(outs: list) -> dict[str, float]:
    """Metrics weighed like the loss, as the torch learner does: each micro-batch by its
    share of the whole mini-batch (tokens or sequences over every DP rank), summed over
    micro-batches and DP ranks; so they do not depend on how rows are split."""
    from megatron.core import parallel_state as ps

    keys = sorted(k for k in outs[0] if k != "_share")
    vals = torch.tensor([sum(o[k] * o["_share"] for o in outs) for k in keys],
                        dtype=torch.float64, device=torch.cuda.current_device())  # fmt: skip
    torch.distributed.all_reduce(vals, group=ps.get_data_parallel_group())
    return dict(zip(keys, vals.tolist(), strict=True))

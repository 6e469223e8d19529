"""The one DTensor helper the learner's layers share (lora, the critic and FSDP2 all need it; it
lives apart so that `lora` does not import `torch.fsdp`, which imports `lora`)."""

from __future__ import annotations

import torch


def local_value(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor: the full value of a DTensor (a collective), else the tensor itself."""
    full = getattr(value, "full_tensor", None)
    return full() if full is not None else value

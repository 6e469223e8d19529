"""Per-rank Megatron optimizer state in checkpoints (`learner/megatron/optim_state.py`): the
layout check and the save/load round trip on an optimizer with the interface Megatron's have
(`state_dict`/`load_state_dict`). The real Megatron ranks (the distributed optimizer included)
resume bit-exactly in `tests/test_megatron_cpu_emulation.py` (slow, needs megatron-core)."""

from __future__ import annotations

import io

import pytest
import torch

from asyncrl.learner.megatron.optim_state import (
    OptimizerLayoutError,
    check_layout,
    load_rank_state,
    parallel_layout,
    rank_state,
)

PARALLEL = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
            "virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1}  # fmt: skip


def test_the_layout_names_every_size_and_megatrons_none_is_one():
    layout = parallel_layout(PARALLEL, world=4, distributed=True)
    assert layout == {"world": 4, "tensor_model_parallel_size": 2,
                      "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
                      "virtual_pipeline_model_parallel_size": 1,
                      "distributed_optimizer": True}  # fmt: skip


def test_another_layout_is_refused_in_one_line_naming_what_changed():
    saved = parallel_layout(PARALLEL, 4, True)
    check_layout(saved, dict(saved))  # the same layout passes
    check_layout(None, saved)  # an older single-rank save carries none
    now = parallel_layout({**PARALLEL, "tensor_model_parallel_size": 1}, 2, True)
    with pytest.raises(OptimizerLayoutError) as e:
        check_layout(saved, now)
    msg = str(e.value)
    assert "\n" not in msg
    assert "tensor_model_parallel_size 2 -> 1" in msg and "world 4 -> 2" in msg
    assert "load_contents" in msg


def _trained(seed: int) -> tuple[torch.nn.Linear, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    return model, opt


def test_a_rank_state_round_trips_through_a_checkpoint_file_and_resumes_exactly():
    model, opt = _trained(0)
    saved = io.BytesIO()
    torch.save(rank_state(opt), saved)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 4)

    def one_step(m: torch.nn.Module, o: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
        return {k: v.clone() for k, v in m.state_dict().items()}

    want = one_step(model, opt)
    other, fresh = _trained(1)  # different moments and weights
    other.load_state_dict(weights)
    saved.seek(0)
    load_rank_state(fresh, torch.load(saved, weights_only=True))
    got = one_step(other, fresh)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    steps = [s["step"] for s in fresh.state.values()]
    assert len({id(s) for s in steps}) == len(steps)  # each parameter its own step tensor
    assert all(float(s) == 4.0 for s in steps)


def test_a_state_with_another_number_of_optimizer_parts_is_refused():
    _, opt = _trained(0)
    state = rank_state(opt)
    with pytest.raises(OptimizerLayoutError, match="2 optimizer part"):
        load_rank_state(opt, state * 2)

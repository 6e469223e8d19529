"""TrajectoryGroup validation, construction helpers, versions, and the collate layout."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.learner.collate import Batch, collate
from asyncrl.types import NOT_GENERATED, RecordError, TrajectoryGroup


def _group(**overrides: object) -> TrajectoryGroup:
    """Two responses (2 and 3 tokens) of a 3-token prompt; the last-but-one token is a tool
    token (mask 0, not generated)."""
    fields: dict[str, object] = dict(
        group_id="g0",
        prompt_ids=[11, 12, 13],
        response_lengths=[2, 3],
        response_ids=[21, 22, 31, 32, 33],
        rollout_logprobs=[-0.5, -1.0, -0.25, 0.0, -2.0],
        loss_mask=[1, 1, 1, 0, 1],
        versions=[4, 4, 5, NOT_GENERATED, 6],
        rewards=[1.0, 0.0],
        finish_reasons=["stop", "length"],
    )
    fields.update(overrides)
    return TrajectoryGroup(**fields)  # type: ignore[arg-type]


def test_valid_group_normalises_dtypes() -> None:
    g = _group()
    assert g.n == 2 and g.num_tokens == 5
    assert g.response_ids.dtype == np.int32 and g.loss_mask.dtype == np.uint8
    assert g.rollout_logprobs.dtype == np.float32 and g.rewards.dtype == np.float32
    assert g.offsets().tolist() == [0, 2, 5]
    assert g.response(1).tolist() == [31, 32, 33]
    assert g.response(1, "loss_mask").tolist() == [1, 0, 1]
    assert g.nbytes == 3 * 4 + 2 * 4 + 5 * (4 + 4 + 1 + 4) + 2 * 4


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"group_id": ""}, "group_id"),
        ({"group_id": 7}, "group_id"),
        ({"response_lengths": [2, 2]}, "response_ids has 5 tokens"),
        ({"response_lengths": [6, -1]}, "negative response length"),
        ({"rollout_logprobs": [-0.5] * 4}, "rollout_logprobs has 4"),
        ({"rewards": [1.0]}, "2 responses but 1 rewards"),
        ({"finish_reasons": ["stop"]}, "1 finish_reasons"),
        ({"finish_reasons": "stop"}, "finish_reasons must be a list"),
        ({"loss_mask": [1, 1, 2, 0, 1]}, "loss_mask must hold only 0 and 1"),
        ({"loss_mask": [1, 1, 0.5, 0, 1]}, "loss_mask: values do not fit uint8"),
        ({"response_ids": [21, 22, 31, 32, 1.5]}, "response_ids: values do not fit int32"),
        ({"response_ids": [21, 22, 31, 32, 2**40]}, "response_ids: values do not fit int32"),
        ({"prompt_ids": [1, -2]}, "negative token id"),
        ({"prompt_ids": [[1, 2]]}, "prompt_ids must be 1-D"),
        ({"prompt_ids": ["a"]}, "prompt_ids must be numeric"),
        ({"versions": [4, 4, 5, -2, 6]}, "below NOT_GENERATED"),
        ({"versions": [4, 4, 5, 5, NOT_GENERATED]}, "no generating version"),
        ({"rollout_logprobs": [-0.5, np.nan, 0, 0, 0]}, "non-finite"),
        ({"rewards": [np.inf, 0.0]}, "non-finite"),
        ({"advantages": [0.1, 0.2]}, "advantages must be per token"),
        ({"advantages": [0, 0, 0, 0, np.nan]}, "non-finite"),
        ({"metadata": {1: "x"}}, "metadata must be a mapping with str keys"),
        ({"response_ids": None}, "response_ids must be 1-D"),
    ],
)
def test_invalid_groups_raise_record_error(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(RecordError, match=match):
        _group(**overrides)


def test_many_responses_take_the_numpy_checks() -> None:
    # Over 32 responses, lengths and rewards are checked with numpy, not tolist().
    n = 40
    ok = dict(group_id="big", prompt_ids=[1], response_lengths=[1] * n, response_ids=range(n),
              rollout_logprobs=[0.0] * n, loss_mask=[1] * n, versions=[0] * n,
              rewards=[0.0] * n, finish_reasons=["stop"] * n)  # fmt: skip
    assert TrajectoryGroup(**ok).num_tokens == n
    with pytest.raises(RecordError, match="negative response length"):
        TrajectoryGroup(**{**ok, "response_lengths": [2, -1] + [1] * (n - 2)})
    with pytest.raises(RecordError, match="non-finite"):
        TrajectoryGroup(**{**ok, "rewards": [0.0] * (n - 1) + [np.nan]})
    with pytest.raises(RecordError, match="non-finite"):
        TrajectoryGroup(**{**ok, "rollout_logprobs": [0.0] * (n - 1) + [-np.inf]})


def test_masked_generated_token_keeps_its_version() -> None:
    # A generated token may be masked out of the loss and still carry its version.
    g = _group(loss_mask=[1, 0, 1, 0, 1], versions=[4, 4, 5, NOT_GENERATED, 6])
    assert g.min_version() == 4


def test_min_and_max_version_ignore_tool_tokens() -> None:
    g = _group(versions=[4, 4, 5, NOT_GENERATED, 6])
    assert (g.min_version(), g.max_version()) == (4, 6)
    only_tool = _group(response_lengths=[1, 0], response_ids=[9], rollout_logprobs=[0.0],
                       loss_mask=[0], versions=[NOT_GENERATED])  # fmt: skip
    assert only_tool.min_version() == NOT_GENERATED == only_tool.max_version()


def test_from_responses_concatenates_and_defaults_mask() -> None:
    g = TrajectoryGroup.from_responses(
        "p1",
        [1, 2],
        [
            {
                "response_ids": [5, 6],
                "rollout_logprobs": [-1, -2],
                "versions": [3, 3],
                "reward": 1.0,
                "finish_reason": "stop",
                "advantages": [0.5, 0.5],
            },
            {
                "response_ids": [7],
                "rollout_logprobs": [-3],
                "versions": [NOT_GENERATED],
                "reward": 0.0,
                "finish_reason": "length",
                "loss_mask": [0],
                "advantages": [-1],
            },
        ],  # fmt: skip
        metadata={"task": "t"},
    )
    assert g.response_lengths.tolist() == [2, 1]
    assert g.loss_mask.tolist() == [1, 1, 0]
    assert g.advantages is not None and g.advantages.tolist() == [0.5, 0.5, -1.0]
    assert g.finish_reasons == ["stop", "length"] and g.metadata == {"task": "t"}
    parts = list(g.iter_responses())
    assert [p["response_ids"].tolist() for p in parts] == [[5, 6], [7]]


def test_from_responses_drops_partial_advantages_and_allows_empty() -> None:
    resp = {"response_ids": [5], "rollout_logprobs": [-1], "versions": [0], "reward": 0,
            "finish_reason": "stop"}  # fmt: skip
    g = TrajectoryGroup.from_responses("p", [1], [dict(resp, advantages=[1.0]), resp])
    assert g.advantages is None
    empty = TrajectoryGroup.from_responses("e", [1], [])
    assert empty.n == 0 and empty.num_tokens == 0


def test_equality_is_exact() -> None:
    assert _group() == _group()
    assert _group() != _group(rewards=[1.0, 0.5])
    assert _group() != _group(advantages=[0.0] * 5)
    assert _group() != _group(metadata={"a": 1})


def test_collate_layout_hand_checked() -> None:
    g0 = _group(advantages=[1, 2, 3, 4, 5])
    g1 = _group(group_id="g1", prompt_ids=[7], response_lengths=[1, 4], rewards=[0.5, 0.25],
                loss_mask=[1, 1, 1, 1, 1], versions=[8, 8, 8, 8, 8])  # fmt: skip
    b = collate([g0, g1], pad_id=99)
    assert isinstance(b, Batch)
    assert (b.batch_size, b.prompt_width, b.response_width) == (4, 3, 4)
    assert b.input_ids.tolist() == [
        [11, 12, 13, 21, 22, 99, 99],
        [11, 12, 13, 31, 32, 33, 99],
        [99, 99, 7, 21, 99, 99, 99],
        [99, 99, 7, 22, 31, 32, 33],
    ]
    assert b.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],
        [0, 0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 1, 1],
    ]
    assert b.position_ids.tolist() == [
        [0, 1, 2, 3, 4, 4, 4],
        [0, 1, 2, 3, 4, 5, 5],
        [0, 0, 0, 1, 1, 1, 1],
        [0, 0, 0, 1, 2, 3, 4],
    ]
    assert b.response_mask.tolist() == [[1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert b.rollout_logprobs[1].tolist() == [-0.25, 0.0, -2.0, 0.0]
    assert b.advantages.tolist() == [[1, 2, 0, 0], [3, 4, 5, 0], [0] * 4, [0] * 4]
    assert b.versions.tolist() == [
        [4, 4, -1, -1],
        [5, -1, 6, -1],
        [8, -1, -1, -1],
        [8, 8, 8, 8],
    ]
    assert b.rewards.tolist() == [1.0, 0.0, 0.5, 0.25]
    assert b.group_index.tolist() == [0, 0, 1, 1]
    assert b.prompt_lengths.tolist() == [3, 3, 1, 1]
    assert b.response_lengths.tolist() == [2, 3, 1, 4]


def test_collate_dtypes_and_to_torch() -> None:
    torch = pytest.importorskip("torch")
    b = collate([_group()])
    assert b.input_ids.dtype == np.int64 and b.response_mask.dtype == np.float32
    t = b.to_torch()
    assert b.routes is None  # no group carries routes: no tensor for them
    assert set(t) == {k for k, v in vars(b).items() if v is not None}
    assert t["input_ids"].dtype == torch.int64 and t["response_mask"].dtype == torch.float32
    assert torch.equal(t["versions"], torch.from_numpy(b.versions))


def test_collate_skips_empty_groups_and_rejects_no_rows() -> None:
    empty = TrajectoryGroup.from_responses("e", [1], [])
    b = collate([empty, _group()])
    assert b.group_index.tolist() == [1, 1]  # index into the input list, empty group included
    with pytest.raises(RecordError, match="at least one response"):
        collate([empty])
    with pytest.raises(RecordError, match="at least one response"):
        collate([])


def test_types_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import asyncrl.types, asyncrl.transport.codec, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

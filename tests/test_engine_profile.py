"""Engine-side details of the production path: SGLang's per-token version spans, the staging
device of the weight sender, and the hf server's scratch directory."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from asyncrl.engine.client import EngineReplyError, parse_completion
from asyncrl.engine.hf.launch import launch_hf_server
from asyncrl.engine.process import EngineLaunchError
from asyncrl.weights.group import staging_device
from tests.test_hf_server import make_tiny_model


def reply(spans: object, n: int = 3) -> dict:
    meta = {
        "finish_reason": {"type": "length"},
        "weight_version": "5",
        "prompt_tokens": 2,
        "weight_versions": spans,
        "output_token_logprobs": [[-0.1, 7, None]] * n,
    }
    return {"output_ids": [7] * n, "meta_info": meta}


def test_sglang_weight_version_spans_label_each_token():
    """SGLang 0.5.23: tokens sampled before an update keep their own version (they used to
    all get the request's final one)."""
    spans = [{"version": "4", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 3}]
    assert parse_completion("u", reply(spans), True).token_versions() == [4, 4, 5]
    default = [{"version": "default", "start": 0, "end": 3}]
    assert parse_completion("u", reply(default), True).token_versions() == [0, 0, 0]
    assert parse_completion("u", reply([{"version": "v", "start": 0, "end": 0}], 0), True)


@pytest.mark.parametrize(
    "spans, problem",
    [
        ([{"version": "4", "start": 0, "end": 2}], "cover 2 tokens, the output has 3"),
        ([{"version": "4", "start": 1, "end": 3}], "does not continue at token 0"),
        ([{"version": "4", "start": "0", "end": 3}], "is not {version, start, end}"),
        ({"version": "4"}, "not a non-empty list"),
        ([{"version": "x", "start": 0, "end": 3}], "non-integer"),
    ],
)
def test_bad_version_spans_are_named(spans, problem):
    with pytest.raises(EngineReplyError, match=problem):
        parse_completion("u", reply(spans), True)


def test_buckets_are_staged_on_the_learners_device_not_device_0():
    """The collective threads never set a device: the sender stages on the device it was
    made on (the learner's), passed in, never the thread's default device 0."""
    assert staging_device("nccl", torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert staging_device("nccl", None) == torch.device("cuda", 0)
    assert staging_device("gloo", torch.device("cuda", 3)) == torch.device("cpu")


def test_hf_server_scratch_dir_is_removed_on_stop_and_on_a_failed_launch(tmp_path, monkeypatch):
    made: list[Path] = []
    real = tempfile.mkdtemp

    def mkdtemp(**kw):
        made.append(Path(real(**kw)))
        return str(made[-1])

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    make_tiny_model(tmp_path)
    handle = launch_hf_server(tmp_path, extra_args=["--num-threads", "1"])
    assert handle.scratch == made[0] and made[0].is_dir()
    handle.stop()
    assert not made[0].exists()
    with pytest.raises(EngineLaunchError, match="exited"):
        launch_hf_server(tmp_path / "missing", timeout_s=60)
    assert len(made) == 2 and not made[1].exists()
    kept = tmp_path / "logs"  # a log dir the caller gave is the caller's: kept
    kept.mkdir()
    handle = launch_hf_server(tmp_path, log_dir=kept, extra_args=["--num-threads", "1"])
    handle.stop()
    assert handle.scratch is None and list(kept.glob("hf_server_*.log"))

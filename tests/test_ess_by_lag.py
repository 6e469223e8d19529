"""The IS weights' effective sample size by staleness (issue 16, `async.stale_policy`).

Closed forms: the normalised ESS (Σw)² / (n·Σw²) of known weights, split by each sequence's lag
(the learner's version minus the oldest version that generated one of its tokens, the
definition of `replay/staleness_hist`), at token and sequence level, through the objective's
real `correct` with real rollout IS settings."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.algo.importance import (
    RolloutIS,
    ess_by_lag,
    ess_from_lag_sums,
    kl_from_lag_sums,
    kl_lag_sums,
    lag_sums,
)
from asyncrl.config.schema import AlgorithmConfig
from asyncrl.learner import lag_metrics as lm
from asyncrl.learner import objective as obj
from asyncrl.learner.collate import collate
from asyncrl.metrics.batch import BatchMetrics
from asyncrl.types import NOT_GENERATED, TrajectoryGroup

NG = NOT_GENERATED


def test_equal_weights_have_ess_one_at_every_lag():
    weights = torch.full((4, 3), 0.7)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.float32)
    lags = torch.tensor([0, 2, 2, 5])  # row 3 has no valid token: no lag 5 at all
    for level in ("token", "sequence", "geometric"):
        got = ess_by_lag(weights, mask, lags, level)
        assert set(got) == {0, 2}
        assert all(ess == pytest.approx(1.0) for ess, _ in got.values())
    assert ess_by_lag(weights, mask, lags, "token")[2][1] == 3  # tokens of rows 1 and 2
    assert ess_by_lag(weights, mask, lags, "sequence")[2][1] == 2  # the rows themselves


def test_token_level_known_weights():
    weights = torch.tensor([[1.0, 3.0, 9.0], [2.0, 2.0, 5.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.float32)
    got = ess_by_lag(weights, mask, torch.tensor([0, 1, 1]), "token")
    # lag 0: w = (1, 3): 16 / (2 * 10); masked 9 left out
    assert got[0] == (pytest.approx(0.8), 2)
    # lag 1: w = (2, 2, 4, 0): 64 / (4 * 24)
    assert got[1] == (pytest.approx(64 / 96), 4)


def test_sequence_level_counts_each_sequence_once():
    # A sequence weight is broadcast over its tokens: a long sequence is still one sample.
    weights = torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float32)
    got = ess_by_lag(weights, mask, torch.tensor([3, 3, 1]), "sequence")
    assert got[3] == (pytest.approx(9 / (2 * 5)), 2)  # w = (1, 2), not (1, 1, 1, 1, 2, 2)
    assert got[1] == (pytest.approx(1.0), 1)


def test_all_weights_zero_is_ess_zero_and_one_heavy_weight_is_one_over_n():
    mask = torch.ones(3, 2)
    assert ess_by_lag(torch.zeros(3, 2), mask, torch.zeros(3, dtype=torch.long), "token") == {
        0: (0.0, 6)
    }
    weights = torch.tensor([[5.0, 5.0], [0.0, 0.0], [0.0, 0.0]])
    got = ess_by_lag(weights, mask, torch.zeros(3, dtype=torch.long), "sequence")
    assert got[0] == (pytest.approx(1 / 3), 3)


def test_bad_lags_shape_is_one_line_value_error():
    with pytest.raises(ValueError, match="one staleness per row"):
        ess_by_lag(torch.ones(2, 3), torch.ones(2, 3), torch.zeros(3, dtype=torch.long))


def test_sequence_lags_take_the_oldest_generated_token():
    versions = torch.tensor(
        [
            [4, 4, NG],  # lag 6 - 4
            [3, 5, 5],  # continued across a weight update: as stale as its oldest token
            [NG, 6, NG],  # an environment token first
            [NG, NG, NG],  # nothing generated: 0
        ]
    )
    assert lm.sequence_lags(versions, 6).tolist() == [2, 3, 0, 0]


def _groups() -> list[TrajectoryGroup]:
    def response(versions: list[int]) -> dict:
        k = len(versions)
        return {"response_ids": [5] * k, "rollout_logprobs": [-1.0] * k,
                "versions": versions, "reward": 1.0, "finish_reason": "stop"}  # fmt: skip

    return [
        TrajectoryGroup.from_responses("a", [1, 2], [response([7, 7]), response([7])]),
        TrajectoryGroup.from_responses("b", [1], [response([5, 5, 5]), response([5, 6])]),
        TrajectoryGroup.from_responses("c", [3], [response([6]), response([6, 6])]),
    ]


def test_lag_split_matches_the_staleness_histogram():
    groups = _groups()
    batch = collate(groups).to_torch("cpu")
    version = 7  # the learner's version while it trains on them
    lags = lm.sequence_lags(batch["versions"], version)
    assert lags.tolist() == [0, 0, 2, 2, 1, 1]
    hist = {
        int(k.rsplit("/", 1)[1]): v
        for k, v in BatchMetrics()(groups, version + 1, 0.0).items()
        if k.startswith("replay/staleness_hist/")
    }
    mask = batch["response_mask"].float()
    units = {
        k: n for k, (_, n) in ess_by_lag(torch.ones_like(mask), mask, lags, "sequence").items()
    }
    assert units == {lag: 2 * groups_at_lag for lag, groups_at_lag in hist.items()}


def _settings(level: str, apply: bool = True) -> tuple[AlgorithmConfig, RolloutIS]:
    alg = AlgorithmConfig(rollout_is_threshold=10.0, rollout_is_level=level, rollout_is=apply)
    return alg, obj.rollout_is_settings(alg)


def test_correct_reports_ess_by_lag_of_the_sequence_weights():
    # Sequence level: w = exp(Σ_t (old - rollout)); rows 0, 1 at lag 0 with w = 1 and e,
    # row 2 at lag 3 with w = e^2 (<= 10, not truncated).
    rollout = torch.zeros(3, 2)
    old = torch.tensor([[0.0, 0.0], [0.5, 0.5], [1.0, 1.0]])
    mask = torch.ones(3, 2)
    alg, settings = _settings("sequence")
    lags = torch.tensor([0, 0, 3])
    weights, _, metrics = obj.correct(alg, settings, "vanilla", old, rollout, mask, lags)
    assert weights is not None
    e = math.e
    assert metrics["is/ess_by_lag/0"] == pytest.approx((1 + e) ** 2 / (2 * (1 + e * e)))
    assert metrics["is/units_by_lag/0"] == 2.0
    assert metrics["is/ess_by_lag/3"] == pytest.approx(1.0)
    assert metrics["is/units_by_lag/3"] == 1.0
    # Without lags the metrics are the mismatch ones alone; metrics-only IS still reports ESS.
    assert not any(k.startswith("is/") for k in obj.correct(alg, settings, "vanilla", old,
                                                            rollout, mask)[2])  # fmt: skip
    alg_off, off = _settings("sequence", apply=False)
    weights, _, again = obj.correct(alg_off, off, "vanilla", old, rollout, mask, lags)
    assert weights is None and again["is/ess_by_lag/0"] == metrics["is/ess_by_lag/0"]


def test_correct_token_level_truncated_and_vetoed_weights():
    # Token level, truncate at 2: token ratios e^0.2 and e^5 -> 2 (truncated); a token with
    # ratio e^-10 < 1e-4 vetoes its whole row (weights 0).
    rollout = torch.zeros(2, 2)
    old = torch.tensor([[0.2, 5.0], [0.0, -10.0]])
    mask = torch.ones(2, 2)
    alg = AlgorithmConfig(rollout_is_threshold=2.0, rollout_is_level="token")
    settings = obj.rollout_is_settings(alg)
    lags = torch.tensor([1, 1])
    _, _, metrics = obj.correct(alg, settings, "vanilla", old, rollout, mask, lags)
    w = np.array([math.exp(0.2), 2.0, 0.0, 0.0])
    assert metrics["is/ess_by_lag/1"] == pytest.approx(w.sum() ** 2 / (4 * (w**2).sum()))
    assert metrics["is/units_by_lag/1"] == 4.0


def test_shard_sums_add_up_to_the_batch():
    # What the ranks' all-reduce relies on: lag_sums of shards add up to the whole batch's.
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(6, 5, generator=gen) * 2
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    lags = torch.tensor([0, 3, 1, 0, 3, 2])
    for level in ("token", "sequence"):
        whole = lag_sums(weights, mask, lags, level)
        a, b = (
            lag_sums(weights[:3], mask[:3], lags[:3], level),
            lag_sums(weights[3:], mask[3:], lags[3:], level),
        )
        size = max(len(a), len(b))
        pad = [torch.cat((x, torch.zeros(size - len(x), 3, dtype=x.dtype))) for x in (a, b)]
        assert torch.allclose(pad[0] + pad[1], whole)
        assert ess_from_lag_sums(whole) == ess_by_lag(weights, mask, lags, level)


def test_kl_by_lag_is_the_mean_k3_of_each_lags_valid_tokens():
    # k3 of lr = old - rollout is exp(lr) - lr - 1: 0 where the policies agree, e - 2 at lr 1,
    # 1/e at lr -1; masked tokens and rows of other lags stay out of a lag's mean.
    rollout = torch.zeros(3, 3)
    old = torch.tensor([[0.0, 1.0, 7.0], [-1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    lags = torch.tensor([2, 2, 0])
    sums = kl_lag_sums(old, rollout, mask, lags)
    assert sums.shape == (3, 2) and sums[1].tolist() == [0.0, 0.0]  # lag 1: no token
    got = kl_from_lag_sums(sums)
    e = math.e
    assert set(got) == {0, 2}
    assert got[2] == pytest.approx(((e - 2) + 1 / e) / 5)  # (0, e-2) + (1/e, 0, 0)
    assert got[0] == pytest.approx(e - 2)
    alg, settings = _settings("geometric")
    _, _, metrics = obj.correct(alg, settings, "vanilla", old, rollout, mask, lags)
    assert metrics["is/kl_by_lag/2"] == pytest.approx(got[2])
    # what the ranks' all-reduce relies on: shard sums add up to the batch's
    a, b = kl_lag_sums(old[:2], rollout[:2], mask[:2], lags[:2]), kl_lag_sums(
        old[2:], rollout[2:], mask[2:], lags[2:])  # fmt: skip
    assert torch.allclose(a + torch.cat((b, torch.zeros(2, 2, dtype=b.dtype))), sums)
    with pytest.raises(ValueError, match="lags must be >= 0"):
        kl_lag_sums(old, rollout, mask, torch.tensor([0, -1, 0]))


def test_negative_lag_is_refused():
    with pytest.raises(ValueError, match="lags must be >= 0"):
        ess_by_lag(torch.ones(2, 2), torch.ones(2, 2), torch.tensor([0, -1]))


def _rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    weights, mask, lags = _shards()[rank]
    got = lm.lag_metrics(weights, mask, lags, "sequence", True, _logprobs(weights))
    Path(out, f"rank{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


def _shards():
    # rank 0 holds lags 0 and 1, rank 1 lags 0 and 3: different key sets before the reduce
    w0 = torch.tensor([[1.0, 1.0], [2.0, 2.0], [0.5, 0.0]])
    w1 = torch.tensor([[3.0, 3.0], [1.0, 0.0]])
    m0, m1 = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]), torch.ones(2, 2)
    return [(w0, m0, torch.tensor([0, 0, 1])), (w1, m1, torch.tensor([0, 3]))]


def _logprobs(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, rollout) with old - rollout = log of the weight + 0.1 (finite at weight 0)."""
    return (weights + 0.1).log(), torch.zeros_like(weights)


def test_all_ranks_report_the_whole_batch(tmp_path):
    import torch.multiprocessing as tmp_mp

    init = f"file://{tmp_path / 'rendezvous'}"
    ctx = tmp_mp.start_processes(_rank, args=(init, str(tmp_path)), nprocs=2, join=False,
                                 start_method="spawn")  # fmt: skip
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "ranks did not finish"
    finally:
        for proc in ctx.processes:  # a rank left hanging is ended, not left to the box
            if proc.is_alive():
                proc.terminate()
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert got[0] == got[1]  # one key set, one value each: what mean_over_ranks needs
    # The whole batch, sequence level: lag 0 rows w = (1, 2, 3): 36 / (3 * 14); lag 1 (0.5)
    # and lag 3 (the mean of (1, 0) over both valid tokens: 0.5) are one sequence each.
    (w0, m0, l0), (w1, m1, l1) = _shards()
    weights = torch.cat((w0, w1))
    whole = lm.lag_metrics(weights, torch.cat((m0, m1)), torch.cat((l0, l1)), "sequence",
                            logprobs=_logprobs(weights))  # fmt: skip
    assert got[0] == pytest.approx(whole)
    assert got[0]["is/ess_by_lag/0"] == pytest.approx(36 / (3 * 14))
    metrics = ("ess", "units", "kl", "seq_ess", "seq_units")
    assert set(got[0]) == {f"is/{m}_by_lag/{k}" for m in metrics for k in (0, 1, 3)}
    # The untruncated sequence ratios Π(w + 0.1) over valid tokens: lag 0's largest is on
    # rank 1 (3.1²), rank 0's on lag 0 is 2.1²; the MAX-then-SUM reduce gives the batch's ESS.
    seq = [1.1**2, 2.1**2, 3.1**2]
    assert got[0]["is/seq_ess_by_lag/0"] == pytest.approx(
        sum(seq) ** 2 / (3 * sum(x * x for x in seq))
    )
    assert got[0]["is/seq_units_by_lag/0"] == 3.0 and got[0]["is/seq_ess_by_lag/3"] == 1.0
    k3 = lambda w: (w + 0.1) - math.log(w + 0.1) - 1  # noqa: E731 - exp(lr) - lr - 1
    assert got[0]["is/kl_by_lag/1"] == pytest.approx(k3(0.5))  # one valid token
    assert got[0]["is/kl_by_lag/3"] == pytest.approx((k3(1.0) + k3(0.0)) / 2)


@pytest.mark.parametrize("reuse", [True, False])
def test_a_learner_step_reports_the_ess_by_lag(tiny_model, reuse):
    """Through the real torch learner, on both proximal-logprob paths (taken from the training
    forward, or recomputed): every trained sequence is counted under its lag."""
    from tests.test_torch_learner import _groups, _learner

    extra = [] if reuse else ["actor.ppo_epochs=2"]  # two epochs: the recompute path
    learner = _learner(tiny_model, "algorithm.rollout_is=true", *extra)
    groups = _groups()
    metrics = learner.step(groups)
    rows = sum(len(g.rewards) for g in groups)
    counted = sum(v for k, v in metrics.items() if k.startswith("is/units_by_lag/"))
    assert 0 < counted <= rows * groups[0].loss_mask.shape[-1]
    assert all(0 < v <= 1 for k, v in metrics.items() if k.startswith("is/ess_by_lag/"))

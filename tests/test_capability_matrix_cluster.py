"""The capability matrix's cluster keys that reach the learner's ranks, each with its effect
checked on a real two-rank learner (rank 1 a Ray actor, the one-host placement):
`cluster.learner_env` is in every rank's environment, the driver's (rank 0) included, and
`cluster.collective_timeout_s` bounds a collective that a rank never joins (the lost-rank
case): it fails after the timeout instead of waiting forever. Multi-node placement and the
refusals of these keys: tests/test_multinode_learner.py, tests/test_multinode_rank_plan.py."""

from __future__ import annotations

import os
import threading

import torch

from asyncrl.config import load_config
from asyncrl.learner.placement import RankPlacement
from asyncrl.learner.torch.distributed import DistributedTorchLearner
from tests.test_torch_learner import _learner

MARK = "ASYNCRL_TEST_LEARNER_ENV"


def test_learner_env_and_collective_timeout_reach_the_ranks(tiny_model, monkeypatch):
    cfg = load_config(None, [f"cluster.learner_env={{{MARK}: placed}}",
                             "cluster.collective_timeout_s=3"])  # fmt: skip
    placement = RankPlacement.from_config(cfg)
    assert placement.env == {MARK: "placed"} and placement.collective_timeout_s == 3.0
    monkeypatch.setenv(MARK, "unset")  # restored after the test
    single = _learner(tiny_model)
    dist = DistributedTorchLearner(
        2, placement, model_path=tiny_model, train=single.train, actor=single.actor,
        algorithm=single.algorithm, temperature=0.7, total_steps=10,
    )  # fmt: skip
    try:
        assert dist.ranks[0]["env"][MARK] == "placed"  # rank 1 (a Ray actor)
        assert os.environ[MARK] == "placed"  # rank 0 (this process)
        # rank 1 idles: an all-reduce only rank 0 enters must fail after the group's timeout
        ended, failure = threading.Event(), []

        def lonely() -> None:
            try:
                torch.distributed.all_reduce(torch.ones(1))
            except Exception as e:  # gloo's timeout
                failure.append(e)
            ended.set()

        threading.Thread(target=lonely, daemon=True).start()
        assert ended.wait(timeout=120), "the collective outlived cluster.collective_timeout_s"
        assert failure and "Timed out waiting 3000ms" in str(failure[0]), failure
    finally:
        dist.close()

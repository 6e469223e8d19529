"""Multi-turn episodes through the real hf engine server (fp32, a tiny random model): token
alignment with the learner, masks, advantages and environment faults."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from asyncrl.config.schema import EnvConfig, GeneratingArgs
from asyncrl.data.prompts import PromptItem
from asyncrl.engine.hf.launch import launch_hf_server
from asyncrl.learner.collate import collate
from asyncrl.orchestrator import GroupLimits, check_group
from asyncrl.rollout.chat_tokens import TurnTemplate
from asyncrl.rollout.multiturn import EpisodeBuilder, EpisodeError
from asyncrl.rollout.settings import PermanentRolloutError, RolloutSettings
from asyncrl.rollout.single_turn import GroupBuilder
from asyncrl.rollout.worker import make_builder
from asyncrl.types import NOT_GENERATED
from tests import env_fixtures

FIX = "tests.env_fixtures:"


@pytest.fixture(scope="module")
def server(tiny_model):
    handle = launch_hf_server(tiny_model, dtype="fp32", seed=3, extra_args=["--num-threads", "1"])
    yield handle
    handle.stop()


def settings(server, tiny_model, env: str = "ScriptedEnv", n: int = 3, **env_kw) -> RolloutSettings:
    env_cfg = EnvConfig(name=FIX + env, **{"max_turns": 4, "step_timeout_s": 10.0, **env_kw})
    return RolloutSettings(
        engine_urls=[server.url], transport_host="127.0.0.1", transport_port=0,
        tokenizer_path=str(tiny_model), n=n, generating=GeneratingArgs(max_new_tokens=6),
        env=env_cfg, response_length=240, seed=0,
    )  # fmt: skip


def build(s: RolloutSettings, seed: int = 3):
    builder = EpisodeBuilder(s)

    async def go():
        try:
            return await builder.build(PromptItem(f"seed-{seed}", [], metadata={"env_seed": seed}))
        finally:
            for c in builder.clients:
                await c.close()

    return builder, asyncio.run(go())


def segments(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of a 0/1 array."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((int(mask[start]), start, i))
            start = i
    return out


def test_learner_logprobs_match_engine_across_turns(server, tiny_model):
    """The learner's fp32 recompute on the stitched sequence equals the engine's per-turn
    logprobs on every generated token, including those after observations."""
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.logprobs import token_logprobs

    _, group = build(settings(server, tiny_model))
    assert group.n == 3 and all(r == "stop" for r in group.finish_reasons)
    for i in range(group.n):  # three generated turns, two observations between them
        runs = segments(group.response(i, "loss_mask"))
        assert [v for v, _, _ in runs] == [1, 0, 1, 0, 1]
    batch = collate([group], pad_id=0).to_torch("cpu")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        recomputed, _ = token_logprobs(model, batch, temperature=1.0)
    gen = batch["response_mask"].bool()
    diff = (recomputed - batch["rollout_logprobs"])[gen].abs()
    assert gen.sum() >= 3 * 3 * 1 and float(diff.max()) < 1e-4


def test_masks_versions_and_observation_tokens(server, tiny_model):
    builder, group = build(settings(server, tiny_model))
    tt = TurnTemplate(builder.tokenizer)
    for i in range(group.n):
        ids, mask = group.response(i), group.response(i, "loss_mask")
        versions, lps = group.response(i, "versions"), group.response(i, "rollout_logprobs")
        assert np.array_equal(mask == 0, versions == NOT_GENERATED)
        assert np.all(lps[mask == 0] == 0) and np.all(versions[mask == 1] == 0)
        observations = [(s, e) for v, s, e in segments(mask) if v == 0]
        for turn, (start, end) in enumerate(observations, start=1):
            role = "tool" if turn % 2 else "user"
            expected = tt.observation_ids(
                [{"role": role, "content": f"obs {turn}"}], ids[start - 1]
            )
            assert ids[start:end].tolist() == expected
    assert group.metadata["env/observation_tokens"] == int((group.loss_mask == 0).sum())
    assert group.metadata["env/turns"] == 9 and group.metadata["env/failed"] == 0
    # asyncrl's keys at the top, the prompt row's fields (the env seed) under "data"
    assert group.metadata["prompt_key"] == "seed-3" and group.metadata["data"] == {"env_seed": 3}
    assert check_group(group, GroupLimits(len(builder.tokenizer), lambda: 0)) == "seed-3"


def test_a_prompt_without_env_seed_fails_permanently(server, tiny_model):
    builder = EpisodeBuilder(settings(server, tiny_model))
    with pytest.raises(PermanentRolloutError, match="has no env_seed"):
        asyncio.run(builder.build(PromptItem("e0-i0", [1, 2], metadata={"answer": "2"})))


def test_trajectory_and_per_step_advantages(server, tiny_model):
    _, group = build(settings(server, tiny_model))  # identical returns: GRPO advantage 0
    assert np.allclose(group.rewards, 3.0) and np.all(group.advantages == 0)
    _, group = build(settings(server, tiny_model, advantage_mode="per_step"))
    for i in range(group.n):  # turn rewards 0.5, 1.0, 1.5 -> returns-to-go 3.0, 2.5, 1.5
        adv, mask = group.response(i, "advantages"), group.response(i, "loss_mask")
        per_turn = [float(adv[s]) for v, s, e in segments(mask) if v == 1]
        assert per_turn[0] > per_turn[1] > per_turn[2]
        assert np.all(adv[mask == 0] == 0)


def test_env_that_raises_fails_its_episode_only(server, tiny_model):
    env_fixtures.FlakyEnv.reset_counters()
    _, group = build(settings(server, tiny_model, env="FlakyEnv"))
    failed = [i for i, r in enumerate(group.finish_reasons) if r == "env_error"]
    assert len(failed) == 1 and group.metadata["env/failed"] == 1
    assert "simulated env crash" in group.metadata["env/error"]
    bad = failed[0]
    assert group.response(bad).size > 0  # its tokens are kept, visibly, but not trained on
    assert (
        not group.response(bad, "loss_mask").any() and not group.response(bad, "advantages").any()
    )
    assert group.rewards[bad] == 0


def test_hung_env_step_times_out(server, tiny_model):
    env_fixtures.HangingEnv.reset_counters()
    env_fixtures.HangingEnv.hang_s = 60.0
    start = time.monotonic()
    _, group = build(settings(server, tiny_model, env="HangingEnv", step_timeout_s=0.5))
    assert time.monotonic() - start < 30
    assert group.metadata["env/timeouts"] == 1 and group.finish_reasons.count("env_timeout") == 1


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ("AlwaysRaisesEnv", "all 3 episodes failed"),
        ("ResetRaisesEnv", "reset(seed=3)"),
        ("NondeterministicEnv", "not deterministic"),
        ("BadRewardEnv", "not finite"),
    ],
)
def test_prompt_level_failures_raise_for_reissue(server, tiny_model, env, fragment):
    env_fixtures.NondeterministicEnv.reset_counters()
    with pytest.raises(EpisodeError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        build(settings(server, tiny_model, env=env))


def test_turn_and_token_limits(server, tiny_model):
    _, group = build(settings(server, tiny_model, max_turns=2))
    assert group.finish_reasons == ["max_turns"] * 3 and group.metadata["env/turns"] == 6
    s = settings(server, tiny_model)
    s.response_length = 20
    _, group = build(s)
    assert all(r == "length" for r in group.finish_reasons)
    assert int(group.response_lengths.max()) <= 20


def test_make_builder_picks_by_settings(server, tiny_model):
    s = settings(server, tiny_model)
    assert isinstance(make_builder(s), EpisodeBuilder)
    s.env = None
    assert isinstance(make_builder(s), GroupBuilder)


def test_aborted_turn_is_continued_from_its_partial_output(server, tiny_model):
    """pause_mode abort returns a partial turn: it is continued from context + partial ids."""
    from asyncrl.engine.client import Completion

    class AbortOnceClient:  # the engine edge, scripted
        def __init__(self):
            self.requests = []

        async def generate_one(self, req):
            self.requests.append(req)
            first = len(self.requests) == 1
            ids = [5, 6, 7] if first else [8, 2]
            return Completion(ids, [-1.0] * len(ids), "abort" if first else "stop", "0", 1)

    builder = EpisodeBuilder(settings(server, tiny_model))
    client = AbortOnceClient()
    out = asyncio.run(builder._generate(client, [40, 41], 6, "k", 0, 0))
    assert out.ids == [5, 6, 7, 8, 2] and out.finish_reason == "stop"
    second = client.requests[1]
    assert second["input_ids"] == [40, 41, 5, 6, 7]
    assert second["sampling_params"]["max_new_tokens"] == 3


def test_batch_estimators_leave_episode_advantages_to_the_learner(server, tiny_model):
    """reinforce_plus_plus: the episodes carry their returns, no advantages; the learner
    computes them over the whole batch (tests/test_batch_estimators.py)."""
    from asyncrl.config.schema import AlgorithmConfig

    s = settings(server, tiny_model)
    s.algorithm = AlgorithmConfig(adv_estimator="reinforce_plus_plus")
    _, group = build(s)
    assert group.advantages is None
    assert group.rewards.shape == (3,) and np.isfinite(group.rewards).all()

"""Admission in tokens (`async.max_inflight_tokens`): the replay queue with its real admission,
buffer and dispatcher; only the groups are hand-built and the workers faked (the edge).

A prompt is charged n x (its prompt + the most new tokens) when admitted, the charge becomes the
group's real tokens when it arrives, and they are released when it is trained, evicted or
filtered; a prompt starts only while a worst-case prompt still fits."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.data.prompts import PromptItem
from asyncrl.replay import ReplayConfig, ReplayQueue, TokenBudget, group_tokens
from asyncrl.rollout.dispatch import Dispatcher
from asyncrl.run import make_queue
from asyncrl.types import TrajectoryGroup

N, PROMPT, RESPONSE = 2, 4, 10  # group size, longest prompt, most new tokens
WORST = N * (PROMPT + RESPONSE)  # 28: one worst-case prompt


def budget(groups: float) -> TokenBudget:
    return TokenBudget(int(groups * WORST), N, PROMPT, RESPONSE)


def queue(policy: str = "evict", s: int = 4, batch: int = 2, groups: float = 3, **kw):
    hard = kw.pop("hard", 4 if policy == "correct" else None)
    cfg = ReplayConfig(
        s, batch, stale_policy=policy, max_staleness_hard=hard, tokens=budget(groups), **kw
    )
    return ReplayQueue(cfg)


def payload(key: str, prompt_len: int = PROMPT) -> dict:
    return {"key": key, "prompt_ids": list(range(1, prompt_len + 1))}


def start(q: ReplayQueue, *keys: str, prompt_len: int = PROMPT) -> int:
    """Admit what fits of `keys` and hand it to worker 0; returns how many were admitted."""
    granted = q.reserve(len(keys), list(keys), [payload(k, prompt_len) for k in keys])
    q.admission.issue(0, granted)
    return granted


def group(gid: str, version: int, lengths=(3, 5), prompt_len: int = PROMPT) -> TrajectoryGroup:
    responses = [
        {
            "response_ids": np.arange(n) + 10,
            "rollout_logprobs": np.full(n, -0.5),
            "versions": np.full(n, version),
            "reward": float(i % 2),
            "finish_reason": "stop",
        }
        for i, n in enumerate(lengths)
    ]
    return TrajectoryGroup.from_responses(gid, list(range(1, prompt_len + 1)), responses)


def test_charge_at_admission_corrected_on_arrival_released_when_trained():
    q = queue(groups=3)
    assert q.capacity() == 3  # 3 worst-case prompts fit
    assert start(q, "a", "b", "c", "d") == 3  # the token budget, not the group budget (12)
    m = q.metrics()
    assert m["tokens_in_flight"] == m["tokens_held"] == 3 * WORST and q.capacity() == 0
    real = group("a", 0)  # 2 x 4 prompt + 3 + 5 response tokens = 16 < 28
    assert group_tokens(real) == 16
    q.put(real)
    m = q.metrics()
    assert (m["tokens_in_flight"], m["tokens_buffered"], m["tokens_held"]) == (56, 16, 72)
    assert q.capacity() == 0  # 84 - 72 = 12 < 28: still no room for a worst case
    q.put(group("b", 0, lengths=(1, 1)))  # 10 tokens
    assert q.capacity() == 1  # 84 - (28 + 16 + 10) = 30: one more fits
    assert q.take(2, 0) is not None  # trained: their tokens are released
    m = q.metrics()
    assert m["tokens_buffered"] == 0 and m["tokens_held"] == WORST and q.capacity() == 2
    assert m["tokens_held_peak"] == 3 * WORST and m["tokens_buffered_peak"] == 26
    assert m["token_budget"] == 3 * WORST


def test_a_prompt_is_charged_its_own_length_so_short_prompts_fit_more():
    q = queue(groups=2)
    assert start(q, "a", "b", prompt_len=1) == 2  # room for 2 worst cases
    held = q.metrics()["tokens_held"]
    assert held == 2 * N * (1 + RESPONSE)  # 44, each charged its own 1-token prompt
    assert q.capacity() == 0  # 56 - 44 < 28: the next could be a worst case
    no_ids = {"key": "env", "prompt_ids": []}  # an env seed: its prompt is templated later
    assert q.config.tokens.estimate(no_ids) == WORST


@pytest.mark.parametrize("why", ["filtered", "evicted on arrival", "evicted later"])
def test_dropped_groups_release_their_tokens(why):
    keep_none = (lambda g: False,) if why == "filtered" else ()
    q = queue("evict", s=1, groups=2, filters=keep_none)
    start(q, "a", "b")
    q.set_version(2 if why == "evicted on arrival" else 0)
    q.put(group("a", 0))
    if why == "evicted later":
        assert q.metrics()["tokens_buffered"] == 16
        q.set_version(2)
    m = q.metrics()
    assert m["tokens_buffered"] == 0 and m["tokens_held"] == WORST  # only "b" in flight
    assert m["filtered" if why == "filtered" else "evicted"] == 1


def test_the_group_budget_still_binds_when_tokens_are_plentiful():
    q = queue(s=0, batch=2, groups=10)  # synchronous: one batch per version
    assert start(q, *"abcd") == 2 and q.capacity() == 0


@pytest.mark.parametrize("policy", ["evict", "wait", "correct"])
def test_every_stale_policy_keeps_the_held_tokens_within_the_budget(policy):
    """A long-tailed stream: admit what fits, deliver the oldest with random lengths, take a
    batch when one is there; the held tokens never pass the budget, and every group's tokens
    come back once it is trained or dropped."""
    rng = np.random.default_rng(0)
    q = queue(policy, s=1, batch=2, groups=4)
    keys, version, limit = (f"p{i}" for i in itertools.count()), 0, 4 * WORST
    for _ in range(60):
        for _ in range(q.capacity()):
            start(q, next(keys), prompt_len=int(rng.integers(1, PROMPT + 1)))
        assert q.admission.held() <= limit
        outstanding = q.admission.outstanding()
        if outstanding:  # the oldest lands, at the version it started at (or one before)
            p = outstanding[0]
            lengths = rng.integers(1, RESPONSE + 1, N)
            q.put(group(p["key"], max(0, version - 1), lengths, len(p["prompt_ids"])))
        if q.take(2, version) is not None:
            version += 1
            q.set_version(version)
        assert q.admission.held() <= limit
    m = q.metrics()
    assert m["tokens_held_peak"] <= limit and m["tokens_buffered_peak"] <= limit
    assert m["taken"] >= 20  # it kept training: no deadlock at a one-batch-plus budget
    buffered = sum(group_tokens(g) for g in q._buffer.take(len(q), version) or [])
    assert buffered == m["tokens_buffered"]  # the tally is exactly the groups' tokens


@pytest.mark.parametrize("policy", ["evict", "wait", "correct"])
def test_resume_restores_the_token_count(policy):
    q = queue(policy, s=1, groups=3)
    start(q, "a", "b", "c")
    q.put(group("a", 0))
    before = q.metrics()
    resumed = queue(policy, s=1, groups=3)
    resumed.load_state_dict(q.state_dict())
    after = resumed.metrics()
    for key in ("tokens_in_flight", "tokens_buffered", "tokens_held", "tokens_held_peak"):
        assert after[key] == before[key], key
    assert resumed.capacity() == q.capacity() == 0
    resumed.take(1, 0)  # the restored group's tokens are released as any other's
    assert resumed.metrics()["tokens_held"] == 2 * WORST and resumed.capacity() == 1
    resumed.put(group("b", 0, lengths=(1, 1)))  # a re-issued prompt's group lands: 10 tokens
    assert resumed.metrics()["tokens_held"] == WORST + 10


class SubmitPool:
    """Workers that only take submissions (the dispatcher's round is what is tested)."""

    def __init__(self) -> None:
        self.items: list[PromptItem] = []

    def size(self) -> int:
        return 1

    def submit(self, worker: int, items: list[PromptItem]) -> int:
        self.items += items
        return len(self.items)

    def wake(self) -> None:
        pass


def test_the_dispatcher_admits_as_many_short_prompts_as_their_charges_allow():
    q = queue(s=4, batch=2, groups=5)  # 140 tokens: 5 worst cases
    counter = itertools.count()
    draw = lambda: PromptItem(f"k{next(counter)}", [1])  # noqa: E731 - 1-token prompts: 22 each
    pool = SubmitPool()
    Dispatcher(pool, q, draw, max_inflight_per_worker=100).dispatch_once()
    # room for 5 worst cases; charged 22 each, a sixth then fits (140 - 110 >= 28)
    assert len(pool.items) == 6 and q.admission.held() == 6 * 22
    assert next(counter) == 6  # every prompt drawn was admitted: none lost


def test_validation_refuses_a_budget_below_one_batch_at_its_worst_case():
    base = ["rollout_batch_size=2", "num_return_sequences_in_group=3", "prompt_length=8"]
    base += ["response_length=6"]
    assert load_config(None, [*base, "async.max_inflight_tokens=84"]).async_.max_inflight_tokens
    for off in ("0", "null"):
        cfg = load_config(None, [*base, f"async.max_inflight_tokens={off}"])
        assert make_queue(cfg).config.tokens is None
    with pytest.raises(ConfigError, match=r"\(83\) is below one batch .* = 84") as info:
        load_config(None, [*base, "async.max_inflight_tokens=83"])
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="max_inflight_tokens must be > 0"):
        load_config(None, [*base, "async.max_inflight_tokens=-5"])
    # an episode may reach response_length, whatever max_new_tokens says
    env = [*base, "env.name=guess_number", "actor_infer.generating_args.max_new_tokens=2"]
    with pytest.raises(ConfigError, match=r"6 response tokens\) = 84"):
        load_config(None, [*env, "async.max_inflight_tokens=60"])
    single = [*base, "actor_infer.generating_args.max_new_tokens=2"]
    cfg = load_config(None, [*single, "async.max_inflight_tokens=60"])  # 2 x 3 x (8 + 2)
    assert make_queue(cfg).config.tokens == TokenBudget(60, 3, 8, 2)


def test_a_token_budget_below_one_group_is_refused_by_replay_itself():
    with pytest.raises(ValueError, match="below one group's worst case 28"):
        TokenBudget(27, N, PROMPT, RESPONSE)

"""Single-turn rollouts: one prompt in, a scored `TrajectoryGroup` of n responses out.

For each prompt `GroupBuilder` sends its `n` samples as one batched request (SGLang's list
form) through the SGLang-protocol client, continues every aborted one (`finish_reason: abort`,
a weight sync with `pause_mode: abort`) from its partial output until it really finishes
(`generate_continued`: the partial tokens keep their logprobs and versions; one still aborted
after `MAX_CONTINUATIONS` fails the prompt, which is retried and re-issued, never trained as
finished), scores every response with the reward function and computes the group's advantages
(the group estimators: grpo, drgrpo, rloo). No transport: the rollout worker and the
equivalence test's reference loop share it.

The reward function sees the prompt row's fields (`item.metadata`) as they are. In the group's
metadata they travel under `"data"` (see `group_metadata`), apart from asyncrl's own keys, so
no dataset column (`prompt_key`, say) can overwrite what the receive side relies on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import Any

import numpy as np

from asyncrl.algo.dapo import overlong_penalty
from asyncrl.algo.group_advantages import AdvantageParams, estimator_stage, one_group_advantages
from asyncrl.data.prompts import PromptItem
from asyncrl.data.tokenizer import load_decoder
from asyncrl.rollout.settings import (
    PermanentRolloutError,
    RolloutSettings,
    group_metadata,
    request_seed,
    sampling_params,
)
from asyncrl.types import TrajectoryGroup

MAX_CONTINUATIONS = 4  # continuations of one aborted sample before its prompt is re-issued


class AbortedSampleError(RuntimeError):
    """A sample still aborted after MAX_CONTINUATIONS continuations (the engine keeps
    aborting): retriable, the prompt is tried again whole."""


async def generate_continued(client: Any, request: dict, max_new: int, first: Any = None) -> Any:
    """`request` (input_ids, sampling_params, ...) until it finishes other than by abort;
    `first`: its first reply when already asked (a group's batched request).

    An abort cut by a weight sync is re-submitted as a continuation: prompt + partial output,
    `max_new_tokens` reduced by what was generated; the result is one Completion of every
    generated token with its own logprob and version. An abort with a 4xx status is bad input
    (a prompt at the context limit): permanent, never re-issued."""
    out_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    routes = None  # routed experts from position 0 (asked for): kept, the continuation's after
    for attempt in range(MAX_CONTINUATIONS + 1):
        if attempt == 0 and first is not None:
            c = first
        else:
            params = {**request["sampling_params"], "max_new_tokens": max_new - len(out_ids)}
            body = {**request, "input_ids": list(request["input_ids"]) + out_ids}
            c = await client.generate_one({**body, "sampling_params": params})
        if c.finish_reason == "abort" and c.abort_status is not None and c.abort_status < 500:
            raise PermanentRolloutError(f"engine refused the request: {c.abort_message}")
        out_ids += c.output_ids
        logprobs += c.output_logprobs
        versions += c.token_versions()
        routes = keep_routes(routes, c.routed_experts)
        if c.finish_reason != "abort":
            break
        if len(out_ids) >= max_new:  # cut exactly at the budget: it ended by length
            c = dataclasses.replace(c, finish_reason="length")
            break
    else:
        raise AbortedSampleError(f"a sample was aborted {MAX_CONTINUATIONS + 1} times")
    return dataclasses.replace(
        c,
        output_ids=out_ids,
        output_logprobs=logprobs,
        output_token_versions=[str(v) for v in versions],
        prompt_tokens=len(request["input_ids"]),
        routed_experts=routes,
    )


def keep_routes(kept: np.ndarray | None, new: np.ndarray | None) -> np.ndarray | None:
    """The routes of a sample continued after an abort: the positions recorded already keep
    their routes (what the engine used when it sampled the next token), the continuation's
    reply (which prefilled them again, maybe with newer weights) adds only those after them."""
    if new is None:
        return kept
    if kept is None or len(kept) == 0:
        return new
    if len(new) <= len(kept):
        return kept
    if new.shape[1] != kept.shape[1]:
        raise PermanentRolloutError(
            f"routed experts of {kept.shape[1]} and then {new.shape[1]} ids per position"
        )
    return np.concatenate([kept, new[len(kept) :]])


class GroupBuilder:
    """Prompt → scored TrajectoryGroup through the engines."""

    def __init__(self, settings: RolloutSettings) -> None:
        from asyncrl.rewards import get_reward_fn

        self.s = settings
        self.clients = settings.engine_clients()
        self._next_engine = itertools.cycle(range(len(self.clients)))
        # decoding only: the `tokenizers` library alone where the driver found it equal
        s = settings
        self.tokenizer = load_decoder(s.tokenizer_path, s.tokenizer_class, s.tokenizer_json)
        self.reward_fn = get_reward_fn(settings.rollout.reward_fn)

    async def build(self, item: PromptItem) -> TrajectoryGroup:
        """The prompt's n samples as one batched request (one HTTP round trip; the engine
        schedules each sample alone), aborted ones continued one by one, scored, with group
        advantages."""
        s, client = self.s, self.clients[next(self._next_engine)]
        requests = [
            {
                "input_ids": list(item.prompt_ids),
                "sampling_params": sampling_params(
                    s.generating, s.max_new_tokens, request_seed(s.seed, item.key, i)
                ),
                "return_logprob": True,
                **({"return_routed_experts": True} if s.routed_experts else {}),
            }
            for i in range(s.n)
        ]
        max_new = s.max_new_tokens
        firsts = await client.generate(requests)
        completions = await asyncio.gather(
            *(generate_continued(client, r, max_new, c) for r, c in zip(requests, firsts))
        )
        return self._build_group(item, completions)

    def _build_group(self, item: PromptItem, completions: list[Any]) -> TrajectoryGroup:
        alg = self.s.algorithm
        responses = []
        for c in completions:
            text = self.tokenizer.decode(c.output_ids, skip_special_tokens=True)
            reward = self._reward(item, text)
            responses.append(
                {
                    "response_ids": c.output_ids,
                    "rollout_logprobs": c.output_logprobs,
                    "versions": c.token_versions(),
                    "reward": reward,
                    "finish_reason": c.finish_reason,
                    "routes": c.routed_experts,
                }
            )
        rewards = np.array([r["reward"] for r in responses], dtype=np.float32)
        if alg.overlong_buffer_len > 0:
            rewards = rewards + self._overlong(responses)
            for r, value in zip(responses, rewards, strict=True):
                r["reward"] = float(value)
        if estimator_stage(alg.adv_estimator) == "rollout":  # else: the learner's, per batch
            advantages = self._group_advantages(rewards)
            for r, adv in zip(responses, advantages, strict=True):
                r["advantages"] = np.full(len(r["response_ids"]), adv, dtype=np.float32)
        metadata = group_metadata(item.key, item.metadata)
        return TrajectoryGroup.from_responses(item.key, item.prompt_ids, responses, metadata)

    def _reward(self, item: PromptItem, text: str) -> float:
        """The reward of one response. A reward function that raises (a missing column, a bug,
        a non-number) fails the same way on every retry: a permanent error, named in full.
        Only a busy or unreachable remote verifier (timeout, connection) is worth retrying."""
        try:
            return float(self.reward_fn(item.prompt_text, text, item.metadata))
        except (TimeoutError, ConnectionError):
            raise
        except Exception as e:
            raise PermanentRolloutError(
                f"reward_fn {self.s.rollout.reward_fn!r} failed on prompt {item.key}: "
                f"{type(e).__name__}: {e}"
            ) from e

    def _overlong(self, responses: list[dict[str, Any]]) -> np.ndarray:
        lengths = [len(r["response_ids"]) for r in responses]
        alg = self.s.algorithm
        return overlong_penalty(
            lengths, self.s.max_new_tokens, alg.overlong_buffer_len, alg.overlong_penalty_factor
        )

    def _group_advantages(self, rewards: np.ndarray) -> np.ndarray:
        """Outcome advantages within the group (one value per response)."""
        alg = self.s.algorithm
        params = AdvantageParams(norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo)
        return one_group_advantages(alg.adv_estimator, rewards, params)

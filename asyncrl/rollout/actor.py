"""The rollout actor: prompts in, scored `TrajectoryGroup`s out over ZMQ.

Plain Python (the loop wraps it in `ray.remote`), so tests drive it without Ray. For each prompt
it sends `n` concurrent requests through the SGLang-protocol client, scores every response with
the reward function, computes group advantages and pushes the group to the learner's queue.
Failures are per prompt: a prompt whose engine call fails is reported back for re-issue, never
silently dropped.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.config.schema import EnvConfig
from asyncrl.types import TrajectoryGroup

GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo")


@dataclass
class PromptItem:
    """One prompt handed to an actor; `key` is unique over the run and becomes the group id."""

    key: str
    prompt_ids: list[int]
    prompt_text: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class ActorSettings:
    """The actor's own sub-config, assembled by the loop from the run config."""

    engine_urls: list[str]
    transport_host: str
    transport_port: int
    tokenizer_path: str
    n: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    reward_fn: str = "arithmetic_exact"
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    request_timeout_s: float = 300.0
    seed: int = 0
    env: EnvConfig | None = None  # set: multi-turn episodes (EpisodeBuilder) instead of prompts
    max_total_tokens: int = 0  # env episodes: cap on all response tokens (response_length)


@dataclass
class PromptResult:
    key: str
    ok: bool
    error: str = ""
    tokens: int = 0
    reward_mean: float = 0.0


def request_seed(seed: int, key: str, index: int) -> int:
    """A per-request sampling seed: the same prompt gets the same samples whatever the batching."""
    digest = hashlib.blake2b(f"{seed}/{key}/{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class GroupBuilder:
    """Prompt → scored TrajectoryGroup through the engines; no transport (the reference loop
    of the equivalence test and the rollout actor share it)."""

    def __init__(self, settings: ActorSettings) -> None:
        from transformers import AutoTokenizer

        from asyncrl.rewards import get_reward_fn
        from asyncrl.rollout.client import EngineClient

        self.s = settings
        self.clients = [
            EngineClient(u, timeout=settings.request_timeout_s) for u in settings.engine_urls
        ]
        self._next_engine = itertools.cycle(range(len(self.clients)))
        self.tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path)
        self.reward_fn = get_reward_fn(settings.reward_fn)

    def _sampling_params(self, key: str, index: int) -> dict[str, Any]:
        s = self.s
        return {
            "max_new_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "stop_token_ids": list(s.stop_token_ids),
            "sampling_seed": request_seed(s.seed, key, index),
        }

    async def build(self, item: PromptItem) -> TrajectoryGroup:
        """n concurrent requests for one prompt, scored, with group advantages."""
        client = self.clients[next(self._next_engine)]
        requests = [
            {
                "input_ids": list(item.prompt_ids),
                "sampling_params": self._sampling_params(item.key, i),
                "return_logprob": True,
            }
            for i in range(self.s.n)
        ]
        completions = await asyncio.gather(*(client.generate_one(r) for r in requests))
        return self._build_group(item, completions)

    def _build_group(self, item: PromptItem, completions: list[Any]) -> TrajectoryGroup:
        s = self.s
        responses = []
        for c in completions:
            text = self.tokenizer.decode(c.output_ids, skip_special_tokens=True)
            reward = float(self.reward_fn(item.prompt_text, text, item.metadata))
            responses.append(
                {
                    "response_ids": c.output_ids,
                    "rollout_logprobs": c.output_logprobs,
                    "versions": c.token_versions(),
                    "reward": reward,
                    "finish_reason": c.finish_reason,
                }
            )
        rewards = np.array([r["reward"] for r in responses], dtype=np.float32)
        if s.overlong_buffer_len > 0:
            rewards = rewards + self._overlong(responses)
            for r, value in zip(responses, rewards, strict=True):
                r["reward"] = float(value)
        if s.adv_estimator in GROUP_ESTIMATORS:
            advantages = self._group_advantages(rewards)
            for r, adv in zip(responses, advantages, strict=True):
                r["advantages"] = np.full(len(r["response_ids"]), adv, dtype=np.float32)
        metadata = {"prompt_key": item.key, **_plain(item.metadata)}
        return TrajectoryGroup.from_responses(item.key, item.prompt_ids, responses, metadata)

    def _overlong(self, responses: list[dict[str, Any]]) -> np.ndarray:
        from asyncrl.algo.advantages import overlong_penalty

        lengths = [len(r["response_ids"]) for r in responses]
        s = self.s
        penalty = overlong_penalty(
            lengths, s.max_new_tokens, s.overlong_buffer_len, s.overlong_penalty_factor
        )
        return penalty.numpy()

    def _group_advantages(self, rewards: np.ndarray) -> np.ndarray:
        """Outcome advantages within the group (one value per response)."""
        import torch

        from asyncrl.algo.advantages import AdvantageParams, compute_advantages

        scores = torch.as_tensor(rewards).unsqueeze(1)  # [n, 1]: one token carries the score
        params = AdvantageParams(norm_adv_by_std_in_grpo=self.s.norm_adv_by_std_in_grpo)
        adv, _ = compute_advantages(
            self.s.adv_estimator,
            scores,
            torch.ones_like(scores),
            params,
            group_ids=[0] * len(rewards),
        )
        return adv[:, 0].numpy()


def make_builder(settings: ActorSettings) -> GroupBuilder | Any:
    """Single-turn prompts (GroupBuilder) or multi-turn environment episodes (EpisodeBuilder)."""
    if settings.env is not None:
        from asyncrl.rollout.multiturn import EpisodeBuilder

        return EpisodeBuilder(settings)
    return GroupBuilder(settings)


class RolloutWorker:
    """The rollout actor's body: build groups and push them to the learner over ZMQ."""

    def __init__(self, settings: ActorSettings) -> None:
        from asyncrl.transport.zmq import Sender, SenderConfig

        self.builder = make_builder(settings)
        # A ZMQ socket belongs to one thread: it is created and used only by this one worker.
        self._send_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncrl-send")
        config = SenderConfig(host=settings.transport_host, port=settings.transport_port)
        self.sender = self._send_pool.submit(Sender, config).result()

    async def run_prompts(self, items: list[PromptItem]) -> list[PromptResult]:
        """Generate, score and push a group for every prompt; one result per prompt."""
        return list(await asyncio.gather(*(self._one_prompt(item) for item in items)))

    async def _one_prompt(self, item: PromptItem) -> PromptResult:
        try:
            group = await self.builder.build(item)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._send_pool, self.sender.send, group)
        except Exception as e:  # noqa: BLE001 - reported back for re-issue, with the reason
            return PromptResult(item.key, ok=False, error=f"{type(e).__name__}: {e}"[:300])
        return PromptResult(
            item.key, ok=True, tokens=group.num_tokens, reward_mean=float(group.rewards.mean())
        )

    def close(self) -> None:
        self._send_pool.submit(self.sender.close).result()
        self._send_pool.shutdown()


def _plain(metadata: dict[str, Any]) -> dict[str, Any]:
    """Metadata that msgpack can carry (scalars, strings, lists of them)."""
    ok = (str, int, float, bool, type(None))
    return {
        str(k): v
        for k, v in metadata.items()
        if isinstance(v, ok) or (isinstance(v, list) and all(isinstance(x, ok) for x in v))
    }

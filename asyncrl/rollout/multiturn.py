"""Multi-turn environment episodes, token in and token out: `EpisodeBuilder` turns one env seed
into a scored `TrajectoryGroup` of n episodes, the same `build(item)` shape as `GroupBuilder`.

One episode: `reset(seed)` gives the prompt (templated once); then each turn the engine
generates from the ids of the whole history, the generated ids are appended exactly as returned
(with their logprobs and weight versions), the decoded text goes to `env.step`, and the next
observation's templated ids are appended (loss mask 0, version NOT_GENERATED, logprob 0). The
history is never re-tokenized (see `chat_tokens.py`), so the ids the learner recomputes on are
the ids the engine sampled from. The response is everything after the prompt. Routed experts (asked
for with `actor.router_replay: r3`): each position keeps the route of the forward that first
took it: a generated token's from its turn, an observation's from the next turn's prefill, the
last position none (the learner routes it). Limits:
`env.max_turns` model turns and `response_length` response tokens in all.

Faults (nothing disappears silently):
- an env that raises or outlives `env.step_timeout_s` in `step` fails its episode: its tokens
  stay in the group with loss mask 0, reward 0 and advantage 0, it is left out of the group's
  baseline, and the group's metadata counts it (`env/failed`, `env/timeouts`, `env/error`),
  which the loop reports as `env/episodes_failed` and `env/step_timeouts`;
- a failed or hung `reset`, a non-deterministic reset, an engine error, or a group whose every
  episode failed fails the prompt: `build` raises, the worker retries it, then reports the
  prompt failed with the reason, and the dispatcher re-issues it (a prompt without an env seed
  is a permanent error: the run stops).
Env calls run in daemon threads under an asyncio timeout: a hung call cannot block the event
loop, the other episodes or process exit (its thread is abandoned and its env never reused).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.algo.episode import episode_return, per_step_advantages, trajectory_advantages
from asyncrl.algo.group_advantages import estimator_stage
from asyncrl.data.prompts import PromptItem
from asyncrl.data.tokenizer import load_tokenizer
from asyncrl.envs.base import as_messages, check_step
from asyncrl.envs.registry import make_env, resolve_env
from asyncrl.rollout.chat_tokens import TurnTemplate
from asyncrl.rollout.settings import (
    PermanentRolloutError,
    RolloutSettings,
    group_metadata,
    request_seed,
    sampling_params,
)
from asyncrl.rollout.single_turn import keep_routes
from asyncrl.types import NOT_GENERATED, TrajectoryGroup

MAX_CONTINUATIONS = 4  # an aborted turn (pause_mode abort) is continued from its partial output


class EpisodeError(RuntimeError):
    """The prompt (env seed) cannot yield a group; the dispatcher re-issues it."""


class EnvTimeoutError(TimeoutError):
    """An environment call outlived env.step_timeout_s."""


@dataclass
class Episode:
    """One episode's response tokens and what happened in it."""

    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # generated ids per turn
    turn_rewards: list[float] = field(default_factory=list)
    finish_reason: str = "max_turns"
    error: str = ""
    timed_out: bool = False
    solved: bool = False
    invalid_actions: int = 0
    observation_tokens: int = 0
    # routed experts from position 0 (`actor.router_replay: r3`): each position keeps the
    # route of the forward that first took it (an observation's: the next turn's prefill)
    routes: np.ndarray | None = None

    @property
    def failed(self) -> bool:
        return bool(self.error)

    def add_generated(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        start = len(self.ids)
        self.ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.mask += [1] * len(ids)
        self.turn_spans.append((start, len(self.ids)))

    def add_observation(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [NOT_GENERATED] * len(ids)
        self.mask += [0] * len(ids)
        self.observation_tokens += len(ids)

    def record(self, reward: float, info: dict[str, Any]) -> None:
        self.turn_rewards.append(reward)
        self.solved = self.solved or bool(info.get("solved"))
        self.invalid_actions += int(bool(info.get("invalid_action")))

    def fail(self, error: BaseException) -> None:
        self.timed_out = isinstance(error, EnvTimeoutError)
        self.error = f"{type(error).__name__}: {error}"[:300]
        self.finish_reason = "env_timeout" if self.timed_out else "env_error"

    def spread(self, per_turn: np.ndarray) -> np.ndarray:
        """Per-turn values on each turn's generated tokens, 0 on observation tokens."""
        out = np.zeros(len(self.ids), dtype=np.float32)
        for (start, end), value in zip(self.turn_spans, per_turn, strict=False):
            out[start:end] = value
        return out


@dataclass
class TurnOutput:
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    routes: np.ndarray | None = None  # the context's and the turn's positions (asked for)


def run_in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """`fn(*args)` in a daemon thread, as a future of the running loop. Unlike `to_thread`, a
    call that never returns holds no shared pool worker and does not block interpreter exit."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def target() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is gone (the episode timed out long ago)
            pass

    threading.Thread(target=target, daemon=True, name="asyncrl-env").start()
    return fut


class EpisodeBuilder:
    """Env seed → TrajectoryGroup of n concurrent episodes through the engines."""

    def __init__(self, settings: RolloutSettings) -> None:

        if settings.env is None:
            raise ValueError("EpisodeBuilder needs RolloutSettings.env")
        self.s, self.env_cfg = settings, settings.env
        resolve_env(self.env_cfg.name)  # a bad name or path fails when the actor starts
        self.clients = settings.engine_clients()
        self._next_engine = itertools.cycle(range(len(self.clients)))
        self.tokenizer = load_tokenizer(settings.tokenizer_path, settings.tokenizer_class)
        self.template = TurnTemplate(self.tokenizer, self.env_cfg.template)
        self.turn_tokens = self.env_cfg.max_tokens_per_turn or settings.max_new_tokens
        self.max_total = settings.response_length or self.turn_tokens * self.env_cfg.max_turns
        # Training samples at the run's temperature with no priority; held-out evaluation plays
        # the same episodes through `for_eval` copies (rollout/evaluation.py).
        self.greedy: bool = False
        self.priority: int | None = None
        self.pin: int | None = None

    def for_eval(
        self, greedy: bool, priority: int | None, pin: int | None = None
    ) -> EpisodeBuilder:
        """This builder (its tokenizer and template shared) generating greedily (temperature
        0) or at the run's sampling settings, every request at SGLang `priority` and pinned to
        weight version `pin` (`EngineClient.generate`): only for engines that lease a pinned
        version between an episode's turns (`EngineProfile.pinned_linger_s`)."""
        other = copy.copy(self)
        other.greedy, other.priority, other.pin = greedy, priority, pin
        return other

    @property
    def _request_keys(self) -> dict[str, int]:
        """`generate_one`'s priority and pin keywords; training sends none."""
        out = {} if self.priority is None else {"priority": self.priority}
        return out if self.pin is None else {**out, "pin": self.pin}

    async def build(self, item: PromptItem) -> TrajectoryGroup:
        """n episodes of the env seed `item.metadata["env_seed"]`, scored, with advantages."""
        if "env_seed" not in item.metadata:  # no retry can add it: the run stops
            raise PermanentRolloutError(
                f"prompt {item.key} has no env_seed (env runs need seed prompts)"
            )
        seed = int(item.metadata["env_seed"])
        client = self.clients[next(self._next_engine)]
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self.run_episode(client, item.key, seed, i))
                    for i in range(self.s.n)
                ]
        except ExceptionGroup as eg:  # the first cause, not "unhandled errors in a TaskGroup"
            raise _first(eg) from None
        return self.assemble(item, seed, [t.result() for t in tasks])

    async def run_episode(self, client: Any, key: str, seed: int, index: int) -> Episode:
        env = make_env(self.env_cfg.name, self.env_cfg.config)
        ep = Episode()
        try:
            try:
                first = as_messages(await self._env_call(env.reset, seed), "reset observation")
            except Exception as e:  # noqa: BLE001 - a prompt-level fault, re-issued
                ep.timed_out = isinstance(e, EnvTimeoutError)
                raise EpisodeError(f"env reset(seed={seed}): {type(e).__name__}: {e}") from None
            ep.prompt_ids = self.template.prompt_ids(first)
            await self._turns(client, env, ep, key, index)
        finally:
            close = getattr(env, "close", None)
            if callable(close) and not ep.timed_out:  # a hung env may still be in use
                run_in_daemon_thread(close).add_done_callback(lambda f: f.exception())
        return ep

    async def _turns(self, client: Any, env: Any, ep: Episode, key: str, index: int) -> None:
        max_turns = self.env_cfg.max_turns
        for turn in range(max_turns):
            room = self.max_total - len(ep.ids)
            if room <= 0:
                ep.finish_reason = "length"
                return
            context = ep.prompt_ids + ep.ids
            out = await self._generate(
                client, context, min(self.turn_tokens, room), key, index, turn
            )
            if not out.ids:  # the context is full (the engine's length limit): nothing to step
                ep.finish_reason = "length"
                return
            ep.add_generated(out.ids, out.logprobs, out.versions)
            ep.routes = keep_routes(ep.routes, out.routes)
            text = self.tokenizer.decode(out.ids, skip_special_tokens=True)
            try:
                obs, reward, done, info = check_step(await self._env_call(env.step, text))
            except Exception as e:  # noqa: BLE001 - the episode fails, the group stays whole
                ep.fail(e)
                return
            ep.record(reward, info)
            if done:
                ep.finish_reason = "stop"
                return
            if turn + 1 == max_turns:
                break
            obs_ids = self.template.observation_ids(obs, out.ids[-1] if out.ids else None)
            if len(ep.ids) + len(obs_ids) >= self.max_total:  # no room left to answer it
                ep.finish_reason = "length"
                return
            ep.add_observation(obs_ids)
        ep.finish_reason = "max_turns"

    async def _env_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        timeout = self.env_cfg.step_timeout_s
        try:
            return await asyncio.wait_for(run_in_daemon_thread(fn, *args), timeout)
        except TimeoutError:
            name = getattr(fn, "__name__", "call")
            raise EnvTimeoutError(f"env {name} gave no answer within {timeout:g}s") from None

    async def _generate(
        self, client: Any, context: list[int], max_new: int, key: str, index: int, turn: int
    ) -> TurnOutput:
        """One model turn; an aborted request (weights updated with pause_mode abort) is
        continued from its partial output, so a turn is never cut short by a weight sync."""
        s, out = self.s, TurnOutput([], [], [], "abort")
        for attempt in range(MAX_CONTINUATIONS + 1):
            seed = request_seed(s.seed, f"{key}/t{turn}/c{attempt}", index)
            params = sampling_params(s.generating, max_new - len(out.ids), seed, self.greedy)
            request = {"input_ids": context + out.ids, "sampling_params": params}
            if s.routed_experts:
                request["return_routed_experts"] = True
            c = await client.generate_one({**request, "return_logprob": True}, **self._request_keys)
            if c.finish_reason == "abort" and c.abort_status is not None and c.abort_status < 500:
                # SGLang's answer to a context at its limit (status 400): the episode has no
                # room left, as with an empty reply; re-submitting would be refused forever
                out.finish_reason = "length"
                break
            out.ids += c.output_ids
            out.logprobs += c.output_logprobs
            out.versions += c.token_versions()
            out.routes = keep_routes(out.routes, c.routed_experts)
            out.finish_reason = c.finish_reason
            if c.finish_reason != "abort" or len(out.ids) >= max_new:
                break
        if not out.ids and out.finish_reason == "abort":
            raise EpisodeError(f"turn {turn} of {key} was aborted {MAX_CONTINUATIONS + 1} times")
        return out

    def assemble(self, item: PromptItem, seed: int, episodes: list[Episode]) -> TrajectoryGroup:
        if len({tuple(ep.prompt_ids) for ep in episodes}) != 1:
            raise EpisodeError(f"env reset(seed={seed}) is not deterministic in its seed")
        valid = [not ep.failed for ep in episodes]
        if not any(valid):
            raise EpisodeError(f"all {len(episodes)} episodes failed: {episodes[0].error}")
        mode = self.env_cfg.return_mode
        returns = [
            episode_return(ep.turn_rewards, mode) if ok else 0.0 for ep, ok in zip(episodes, valid)
        ]
        advantages = self._advantages(episodes, returns, valid)
        responses = [
            {
                "response_ids": ep.ids,
                "rollout_logprobs": ep.logprobs,
                "versions": ep.versions,
                "loss_mask": np.asarray(ep.mask if ok else [0] * len(ep.ids), np.uint8),
                "reward": ret,
                "finish_reason": ep.finish_reason,
                "routes": ep.routes,
                **({} if adv is None else {"advantages": adv}),
            }
            for ep, ok, ret, adv in zip(episodes, valid, returns, advantages, strict=True)
        ]
        metadata = group_metadata(item.key, item.metadata, **_counts(episodes, returns))
        return TrajectoryGroup.from_responses(item.key, episodes[0].prompt_ids, responses, metadata)

    def _advantages(
        self, episodes: list[Episode], returns: list[float], valid: list[bool]
    ) -> list[np.ndarray] | list[None]:
        """Token advantages per episode (see asyncrl.algo.episode for the two modes); None for
        a batch-level estimator, which the learner computes on the whole batch from the returns."""
        est, norm = self.s.algorithm.adv_estimator, self.s.algorithm.norm_adv_by_std_in_grpo
        if estimator_stage(est) != "rollout":
            return [None] * len(episodes)
        if self.env_cfg.advantage_mode == "per_step":
            rewards = [ep.turn_rewards for ep in episodes]
            turns = per_step_advantages(rewards, valid, est, self.env_cfg.gamma, norm)
            return [ep.spread(t) for ep, t in zip(episodes, turns, strict=True)]
        values = trajectory_advantages(returns, valid, est, norm)
        return [ep.spread(np.full(len(ep.turn_spans), v)) for ep, v in zip(episodes, values)]


def _counts(episodes: list[Episode], returns: list[float]) -> dict[str, Any]:
    """Per-group episode counts for the loop's metrics (asyncrl.metrics.episodes)."""
    ok = [ep for ep in episodes if not ep.failed]
    counts: dict[str, Any] = {
        "env/episodes": len(episodes),
        "env/failed": len(episodes) - len(ok),
        "env/timeouts": sum(ep.timed_out for ep in episodes),
        "env/turns": sum(len(ep.turn_spans) for ep in episodes),
        "env/solved": sum(ep.solved for ep in ok),
        "env/invalid_actions": sum(ep.invalid_actions for ep in episodes),
        "env/generated_tokens": sum(int(sum(ep.mask)) for ep in ok),  # trained on
        "env/observation_tokens": sum(ep.observation_tokens for ep in episodes),
        "env/truncated": sum(ep.finish_reason in ("length", "max_turns") for ep in episodes),
        "env/return_sum": float(sum(r for r, ep in zip(returns, episodes) if not ep.failed)),
    }
    errors = [ep.error for ep in episodes if ep.failed]
    if errors:
        counts["env/error"] = errors[0]
    return counts


def _first(eg: BaseExceptionGroup) -> BaseException:
    error = eg.exceptions[0]
    return _first(error) if isinstance(error, BaseExceptionGroup) else error

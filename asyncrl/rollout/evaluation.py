"""Held-out evaluation off the training loop: greedy accuracy through the engines, pinned to the
weight version a step produced, while the learner goes on training. Env runs play held-out
episodes instead (see "Episodes" below).

`submit(step, version)` sends the held-out prompts to the engines as ordinary requests (the
same SGLang-protocol client, `EVAL_CHUNK` prompts per batched /generate, the same reward
function, greedy `sampling_params`) at SGLang priority `logging.eval_priority` (default -1,
below rollout's 0: on a shared engine evaluation takes the slots rollout leaves free; with
`logging.eval_engine: dedicated` only to the engine the fleet reserves for it, which rollout
never uses) and returns at once; `results()` hands back, keyed by step, every evaluation that
has completed; the loop merges each into the row of its step (`metrics/deferred.py`), written
once it lands.

Pinning: the engines hold one version at a time, so an evaluation of version v must run before
the weights of v+1 reach them. `wait_before_sync()` is called before every weight sync and
blocks until the evaluations in flight are done: an evaluation overlaps the next training step
(its batch wait and learner step), and the loop waits only for what outlasts that (returned,
and counted as learner idle by the loop). A dedicated evaluation engine has a weight group of
its own and is synced only at evaluation steps (`EngineFleet.sync(eval_engine=...)`): the
rollout engines' syncs between two evaluations wait for nothing, and an evaluation has until
the next evaluation step to finish. Every completion's per-token versions are checked:
an evaluation that ran (even in part) under another version (an engine relaunched mid-way is
synced to the learner's newest weights) is dropped and counted (`eval_off_version`), never
logged against a step whose weights it did not measure. An engine error drops the evaluation
too (`eval_failures`); the dead engine is healed by the loop; the run goes on.

Episodes (`settings.env` set): the items are held-out env seeds (`heldout_seed_items`, disjoint
from the training seeds: `data/env_prompts.py`), each played once greedily (temperature 0) and
once sampled (the run's sampling settings, per-request seeds derived from the item's key, so
every evaluation draws the same noise), by the training episodes' own code
(`EpisodeBuilder.run_episode` through a `for_eval` copy that adds greedy and the priority).
Reported per mode as `eval/greedy/*` and `eval/sampled/*` (`metrics/keys.py`): success rate
(the env's `info["solved"]`, `envs/base.py`), mean return (`env.return_mode`), invalid-action
rate per turn, mean turns; an env error fails its episode (counted, left out of the rates), a
failed reset or every episode failing drops the evaluation (`eval_failures`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from asyncrl.algo.episode import episode_return
from asyncrl.config.schema import EnvConfig, LoggingConfig
from asyncrl.data.env_prompts import heldout_seed_rows
from asyncrl.data.prompts import PromptItem
from asyncrl.engine.client import EngineError
from asyncrl.engine.fleet import EngineFleet
from asyncrl.metrics.keys import ACCURACY, EVAL_GREEDY, EVAL_SAMPLED
from asyncrl.rollout.multiturn import Episode, EpisodeBuilder, EpisodeError
from asyncrl.rollout.settings import RolloutSettings, sampling_params
from asyncrl.types import NOT_GENERATED
from asyncrl.weights.sync import WeightSource

#: Episode evaluation modes: the metric prefix of each, and whether it generates greedily.
EPISODE_MODES = {EVAL_GREEDY: True, EVAL_SAMPLED: False}
#: Held-out prompts per batched /generate: a few round trips per evaluation instead of one per
#: prompt (the engine still schedules each prompt alone, at evaluation's priority).
EVAL_CHUNK = 64


def heldout_seed_items(env: EnvConfig, n: int) -> list[PromptItem]:
    """An env run's held-out items: one per held-out env seed, keys `heldout-<i>`."""
    rows = heldout_seed_rows(env, n)
    return [PromptItem(f"heldout-{i}", [], metadata=row) for i, row in enumerate(rows)]


class EvalVersionError(RuntimeError):
    """An evaluation's completions came (in part) from another weight version than pinned."""


@dataclass
class _InFlight:
    step: int
    version: int
    started: float
    future: concurrent.futures.Future


class Evaluator:
    """Every `logging.eval_interval` steps (and at the last one): accuracy on `items`, or with
    `settings.env` the held-out episodes of `items` (env seeds), greedy and sampled."""

    def __init__(
        self,
        logging: LoggingConfig,
        max_steps: int,
        items: list[PromptItem],
        settings: RolloutSettings,
        fleet: EngineFleet,
    ) -> None:
        from transformers import AutoTokenizer

        from asyncrl.rewards import get_reward_fn

        self.interval, self.max_steps, self.items = logging.eval_interval, max_steps, items
        # Rollout requests carry no priority (the engines' default, 0): 0 here sends none.
        self.priority = logging.eval_priority or None
        self.s, self.fleet = settings, fleet
        self.tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path)
        self.reward = get_reward_fn(settings.rollout.reward_fn)
        self.counters: Counter[str] = Counter()
        self.in_flight: list[_InFlight] = []
        self.episodes: dict[str, EpisodeBuilder] = {}  # per mode; empty: single-turn prompts
        if settings.env is not None:
            builder = EpisodeBuilder(settings)
            self.episodes = {
                mode: builder.for_eval(greedy, self.priority)
                for mode, greedy in EPISODE_MODES.items()
            }

    def due(self, step: int) -> bool:
        return self.interval > 0 and (step % self.interval == 0 or step == self.max_steps)

    def submit(self, step: int, version: int, source: WeightSource) -> bool:
        """Start evaluating `step`, whose weights (`version`) the engines hold now, if it is
        due; heal dead engines (to `source`'s weights) first. Returns whether it started."""
        if not self.due(step) or not self.items:
            return False
        self.fleet.heal(source)
        work = self._play(version) if self.episodes else self._generate(version)
        future = asyncio.run_coroutine_threadsafe(work, self.fleet.runner.loop)
        self.in_flight.append(_InFlight(step, version, time.perf_counter(), future))
        return True

    def wait_before_sync(self, eval_engine: bool = True) -> float:
        """Block until every evaluation in flight is done (their engines must not change
        version under them); returns the seconds waited. A sync that leaves a dedicated
        evaluation engine out (`eval_engine` False) waits for nothing."""
        if not eval_engine and self.fleet.eval_index is not None:
            return 0.0
        start = time.perf_counter()
        timeout = self.s.rollout.request_timeout_s * 2
        for ev in self.in_flight:
            try:
                ev.future.result(timeout=max(0.0, timeout - (time.perf_counter() - start)))
            except concurrent.futures.TimeoutError:
                ev.future.cancel()  # reported by `results` as a failure
            except Exception:  # noqa: BLE001 - reported by `results`
                pass
        return time.perf_counter() - start

    def results(self) -> list[tuple[int, dict[str, float]]]:
        """(step, metrics) of every evaluation that completed since the last call, in step
        order; failed ones are counted, reported in one line and dropped."""
        done = [ev for ev in self.in_flight if ev.future.done()]
        self.in_flight = [ev for ev in self.in_flight if not ev.future.done()]
        out = []
        for ev in done:
            try:
                outs = ev.future.result()
            except (
                EngineError,
                EpisodeError,
                EvalVersionError,
                ValueError,
                concurrent.futures.CancelledError,
            ) as e:
                kind = "eval_off_version" if isinstance(e, EvalVersionError) else "eval_failures"
                self.counters[kind] += 1
                print(f"asyncrl: evaluation of step {ev.step} skipped: {type(e).__name__}: {e}")
                continue
            score = self._score_episodes if self.episodes else self._score
            out.append((ev.step, score(*outs, ev)))
        return sorted(out, key=lambda r: r[0])

    def in_flight_steps(self) -> set[int]:
        """The steps whose evaluation has not been collected by `results` yet."""
        return {ev.step for ev in self.in_flight}

    def drain(self) -> list[tuple[int, dict[str, float]]]:
        """Wait for every evaluation in flight and return all results (`results`)."""
        self.wait_before_sync()
        return self.results()

    async def _generate(self, version: int) -> tuple[list[list[int]], float]:
        """The greedy output ids of every item, all generated by weight `version`, and when
        the last one came back (`perf_counter`)."""
        clients = self.fleet.eval_clients()  # logging.eval_engine: one, or all
        params = sampling_params(self.s.generating, self.s.max_new_tokens, greedy=True)
        reqs = [{"input_ids": it.prompt_ids, "sampling_params": params} for it in self.items]
        chunks = [reqs[i : i + EVAL_CHUNK] for i in range(0, len(reqs), EVAL_CHUNK)]
        done = await asyncio.gather(
            *(
                clients[c % len(clients)].generate(chunk, priority=self.priority)
                for c, chunk in enumerate(chunks)
            )
        )
        outs = [o for chunk in done for o in chunk]
        finished = time.perf_counter()
        seen = {v for o in outs for v in (o.token_versions() or [o.version])}
        if seen != {version}:
            ran = sorted(seen, key=str)
            raise EvalVersionError(f"pinned to weight version {version}, ran under {ran}")
        return [o.output_ids for o in outs], finished

    def _score(self, outs: list[list[int]], finished: float, ev: _InFlight) -> dict[str, float]:
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in outs]
        rewards = [
            float(self.reward(it.prompt_text, text, it.metadata))
            for it, text in zip(self.items, texts, strict=True)
        ]
        return {
            "eval/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "eval/reward_mean": sum(rewards) / len(rewards),
            "eval/seconds": finished - ev.started,
            "eval/version": float(ev.version),
        }

    async def _play(self, version: int) -> tuple[dict[str, list[Episode]], float]:
        """Every held-out seed's episode in each mode, all generated by weight `version`, and
        when the last one ended (`perf_counter`)."""
        clients = self.fleet.eval_clients()  # logging.eval_engine: one, or all

        def play(builder: EpisodeBuilder, i: int, item: PromptItem) -> Coroutine[Any, Any, Episode]:
            seed = int(item.metadata["env_seed"])
            return builder.run_episode(clients[i % len(clients)], item.key, seed, 0)

        try:
            async with asyncio.TaskGroup() as tg:  # the first error cancels the others
                tasks = {
                    mode: [tg.create_task(play(b, i, it)) for i, it in enumerate(self.items)]
                    for mode, b in self.episodes.items()
                }
        except ExceptionGroup as eg:  # the cause, not "unhandled errors in a TaskGroup"
            raise eg.exceptions[0] from None
        finished = time.perf_counter()
        played = {mode: [t.result() for t in ts] for mode, ts in tasks.items()}
        seen = {v for eps in played.values() for ep in eps for v in ep.versions}
        if seen - {version, NOT_GENERATED}:  # observation tokens carry NOT_GENERATED
            ran = sorted(seen - {NOT_GENERATED}, key=str)
            raise EvalVersionError(f"pinned to weight version {version}, ran under {ran}")
        for mode, eps in played.items():  # rates over no episode at all would read as 0
            if all(ep.failed for ep in eps):
                raise EpisodeError(f"every held-out episode ({mode}*) failed: {eps[0].error}")
        return played, finished

    def _score_episodes(
        self, played: dict[str, list[Episode]], finished: float, ev: _InFlight
    ) -> dict[str, float]:
        mode = self.s.env.return_mode if self.s.env is not None else "sum"
        out = {"eval/seconds": finished - ev.started, "eval/version": float(ev.version)}
        for prefix, episodes in played.items():
            out |= {prefix + k: v for k, v in episode_scores(episodes, mode).items()}
        out[ACCURACY] = out[EVAL_GREEDY + "solved_frac"]  # what the console and plots show
        return out

    def metrics(self) -> dict[str, float]:
        return {f"rollout/{k}": float(v) for k, v in self.counters.items()}


def episode_scores(episodes: list[Episode], return_mode: str) -> dict[str, float]:
    """Success rate, mean return, invalid actions per turn and mean turns of the episodes that
    did not fail (an env error), and how many failed (named as `metrics/keys.py` says)."""
    ok = [ep for ep in episodes if not ep.failed]
    played, turns = max(1, len(ok)), sum(len(ep.turn_spans) for ep in ok)
    return {
        "solved_frac": sum(ep.solved for ep in ok) / played,
        "return_mean": sum(episode_return(ep.turn_rewards, return_mode) for ep in ok) / played,
        "invalid_action_frac": sum(ep.invalid_actions for ep in ok) / max(1, turns),
        "turns_mean": turns / played,
        "episodes_failed": float(len(episodes) - len(ok)),
    }

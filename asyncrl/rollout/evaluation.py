"""Held-out evaluation off the training loop: greedy accuracy through the engines, pinned to the
weight version a step produced, while the learner goes on training.

`submit(step, version)` sends the held-out prompts to the engines as ordinary requests (the
same SGLang-protocol client, the same reward function, greedy `sampling_params`) at SGLang
priority `logging.eval_priority` (default -1, below rollout's 0: on a shared engine evaluation
takes the slots rollout leaves free) and returns at once; `results()` hands back, keyed by step, every evaluation that has completed; the loop
merges each into the row of its step (`metrics/deferred.py`), written once it lands.

Pinning: the engines hold one version at a time, so an evaluation of version v must run before
the weights of v+1 reach them. `wait_before_sync()` is called before every weight sync and
blocks until the evaluations in flight are done: an evaluation overlaps the next training step
(its batch wait and learner step), and the loop waits only for what outlasts that (returned,
and counted as learner idle by the loop). Every completion's per-token versions are checked:
an evaluation that ran (even in part) under another version (an engine relaunched mid-way is
synced to the learner's newest weights) is dropped and counted (`eval_off_version`), never
logged against a step whose weights it did not measure. An engine error drops the evaluation
too (`eval_failures`); the dead engine is healed by the loop; the run goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import Counter
from dataclasses import dataclass

from asyncrl.config.schema import LoggingConfig
from asyncrl.data.prompts import PromptItem
from asyncrl.engine.client import EngineError
from asyncrl.engine.fleet import EngineFleet
from asyncrl.rollout.settings import RolloutSettings, sampling_params
from asyncrl.weights.sync import WeightSource


class EvalVersionError(RuntimeError):
    """An evaluation's completions came (in part) from another weight version than pinned."""


@dataclass
class _InFlight:
    step: int
    version: int
    started: float
    future: concurrent.futures.Future


class Evaluator:
    """Every `logging.eval_interval` steps (and at the last one): accuracy on `items`."""

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

    def due(self, step: int) -> bool:
        return self.interval > 0 and (step % self.interval == 0 or step == self.max_steps)

    def submit(self, step: int, version: int, source: WeightSource) -> bool:
        """Start evaluating `step`, whose weights (`version`) the engines hold now, if it is
        due; heal dead engines (to `source`'s weights) first. Returns whether it started."""
        if not self.due(step) or not self.items:
            return False
        self.fleet.heal(source)
        future = asyncio.run_coroutine_threadsafe(self._generate(version), self.fleet.runner.loop)
        self.in_flight.append(_InFlight(step, version, time.perf_counter(), future))
        return True

    def wait_before_sync(self) -> float:
        """Block until every evaluation in flight is done (their engines must not change
        version under them); returns the seconds waited."""
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
                EvalVersionError,
                ValueError,
                concurrent.futures.CancelledError,
            ) as e:
                kind = "eval_off_version" if isinstance(e, EvalVersionError) else "eval_failures"
                self.counters[kind] += 1
                print(f"asyncrl: evaluation of step {ev.step} skipped: {type(e).__name__}: {e}")
                continue
            out.append((ev.step, self._score(*outs, ev)))
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
        clients = self.fleet.clients
        params = sampling_params(self.s.generating, self.s.max_new_tokens, greedy=True)
        outs = await asyncio.gather(
            *(
                clients[i % len(clients)].generate_one(
                    {"input_ids": it.prompt_ids, "sampling_params": params},
                    priority=self.priority,
                )
                for i, it in enumerate(self.items)
            )
        )
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

    def metrics(self) -> dict[str, float]:
        return {f"rollout/{k}": float(v) for k, v in self.counters.items()}

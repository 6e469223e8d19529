"""Held-out evaluation: greedy accuracy through the engines, on the weights they serve now.

The same SGLang-protocol client as training rollouts, the same reward function, the one
`sampling_params` (greedy). An engine that dies under an evaluation is healed and the
evaluation tried once more; a second failure skips it (counted), never the run.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from asyncrl.config.schema import LoggingConfig
from asyncrl.data.prompts import PromptItem
from asyncrl.engine.client import EngineError
from asyncrl.engine.fleet import EngineFleet
from asyncrl.rollout.settings import RolloutSettings, sampling_params
from asyncrl.weights.sync import WeightSource


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
        self.s, self.fleet = settings, fleet
        self.tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path)
        self.reward = get_reward_fn(settings.rollout.reward_fn)
        self.counters: Counter[str] = Counter()

    def due(self, step: int) -> bool:
        return self.interval > 0 and (step % self.interval == 0 or step == self.max_steps)

    def maybe(self, step: int, source: WeightSource) -> dict[str, float]:
        """Evaluate if `step` is due; heal dead engines (to `source`'s weights) first."""
        if not self.due(step):
            return {}
        for attempt in range(2):
            self.fleet.heal(source)
            try:
                return self.evaluate()
            except EngineError as e:  # an engine died under the evaluation: heal, try again
                self.counters["eval_failures"] += 1
                if attempt:
                    print(f"asyncrl: evaluation skipped at step {step}: {e}")
        return {}

    def evaluate(self) -> dict[str, float]:
        """Greedy held-out accuracy and mean reward over `items`."""
        if not self.items:
            return {}
        start = time.perf_counter()
        timeout = self.s.rollout.request_timeout_s * 2
        rewards = self.fleet.runner.run(self._rewards(), timeout=timeout)
        return {
            "eval/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "eval/reward_mean": sum(rewards) / len(rewards),
            "eval/seconds": time.perf_counter() - start,
        }

    async def _rewards(self) -> list[float]:
        clients = self.fleet.clients
        params = sampling_params(self.s.generating, self.s.max_new_tokens, greedy=True)
        outs = await asyncio.gather(
            *(
                clients[i % len(clients)].generate_one(
                    {"input_ids": it.prompt_ids, "sampling_params": params}
                )
                for i, it in enumerate(self.items)
            )
        )
        texts = [self.tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
        return [
            float(self.reward(it.prompt_text, text, it.metadata))
            for it, text in zip(self.items, texts, strict=True)
        ]

    def metrics(self) -> dict[str, float]:
        return {f"rollout/{k}": float(v) for k, v in self.counters.items()}

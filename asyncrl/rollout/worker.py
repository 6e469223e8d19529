"""The rollout worker: prompts in, scored `TrajectoryGroup`s out over ZMQ.

Plain Python (the Ray pool wraps it in `ray.remote`), so tests drive it without Ray. Failures
are per prompt: a prompt whose group cannot be built or sent is reported back for re-issue,
never silently dropped.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from asyncrl.data.prompts import PromptItem
from asyncrl.rollout.multiturn import EpisodeBuilder
from asyncrl.rollout.settings import PromptResult, RolloutSettings
from asyncrl.rollout.single_turn import GroupBuilder


def make_builder(settings: RolloutSettings) -> GroupBuilder | EpisodeBuilder:
    """Single-turn prompts (GroupBuilder) or multi-turn environment episodes (EpisodeBuilder)."""
    if settings.env is not None:
        return EpisodeBuilder(settings)
    return GroupBuilder(settings)


class RolloutWorker:
    """Build groups and push them to the learner over ZMQ."""

    def __init__(self, settings: RolloutSettings) -> None:
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

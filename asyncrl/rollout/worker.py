"""The rollout worker: prompts in, scored `TrajectoryGroup`s out over ZMQ.

Plain Python (the Ray pool wraps it in `ray.remote`), so tests drive it without Ray. Failures
are per prompt and classified by `is_retriable`: a retriable one (an engine busy, unreachable
or answering 5xx, a timeout, a full transport, an environment fault) is tried again here with
exponential backoff, then reported failed and re-issued by the dispatcher; any other (a reward
function that raises, a missing data column, an engine's 4xx, a group that cannot be encoded)
is reported at once as permanent, and the dispatcher stops the run with it. Error messages are
passed on whole, never cut.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from asyncrl.data.prompts import PromptItem
from asyncrl.engine.client import EngineError
from asyncrl.engine.replies import http_status
from asyncrl.rollout.multiturn import EpisodeBuilder, EpisodeError
from asyncrl.rollout.settings import PromptResult, RolloutSettings
from asyncrl.rollout.single_turn import AbortedSampleError, GroupBuilder
from asyncrl.types import RecordError

T = TypeVar("T")
#: 4xx answers that mean "not now" rather than "never": timeout, too early, too many requests.
RETRIABLE_HTTP = frozenset({408, 425, 429})


def is_retriable(error: BaseException) -> bool:
    """Whether trying the prompt again may succeed. Anything not known to be transient counts
    as permanent: an unknown error is far likelier a bug than bad luck, and retrying it would
    only stall the run until the batch timeout, hiding the real message."""
    if isinstance(error, EngineError):  # connection refused/reset, timeout, 5xx, bad reply
        status = http_status(error)
        return status is None or status >= 500 or status in RETRIABLE_HTTP
    # TimeoutError: the transport was full, a call outlived its deadline. EpisodeError: an
    # env reset failed or a turn was aborted. RecordError: an engine returned unusable values.
    # AbortedSampleError: a sample kept being aborted (weight syncs in pause_mode abort).
    retriable = (TimeoutError, ConnectionError, EpisodeError, RecordError, AbortedSampleError)
    return isinstance(error, retriable)


def backoff_s(settings: RolloutSettings, attempt: int) -> float:
    """Wait after failed try `attempt` (1-based): doubling from `retry_backoff_s`, capped,
    with jitter so that workers failing together do not come back together."""
    delay = settings.retry_backoff_s * 2 ** (attempt - 1)
    return min(settings.retry_backoff_max_s, delay) * random.uniform(0.5, 1.0)


def make_builder(settings: RolloutSettings) -> GroupBuilder | EpisodeBuilder:
    """Single-turn prompts (GroupBuilder) or multi-turn environment episodes (EpisodeBuilder)."""
    if settings.env is not None:
        return EpisodeBuilder(settings)
    return GroupBuilder(settings)


class RolloutWorker:
    """Build groups and push them to the learner over ZMQ (on a connection that proved the
    run's secret)."""

    def __init__(self, settings: RolloutSettings) -> None:
        from asyncrl.transport.auth import needs_curve
        from asyncrl.transport.batcher import SendBatcher
        from asyncrl.transport.sender import Sender, SenderConfig

        self.settings = settings
        self.builder = make_builder(settings)
        # A ZMQ socket belongs to one thread: it is created and used only by this one worker.
        self._send_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncrl-send")
        config = SenderConfig(
            host=settings.transport_host,
            port=settings.transport_port,
            secret=settings.transport_secret,
            # the receiver's mechanism follows where it binds, not the address dialled here
            curve=needs_curve(settings.rollout.transport_host),
        )
        self.sender = self._send_pool.submit(Sender, config).result()
        # Groups finished while the send thread is busy leave together, in one message.
        self._batcher = SendBatcher(self.sender, self._send_pool)

    async def run_prompts(self, items: list[PromptItem]) -> list[PromptResult]:
        """Generate, score and push a group for every prompt; one result per prompt."""
        stamps = [it.engine_version for it in items if it.engine_version is not None]
        for client in self.builder.clients:  # no request after a sync uses an older namespace
            client.saw_version(max(stamps, default=None))
        return list(await asyncio.gather(*(self._one_prompt(item) for item in items)))

    async def _one_prompt(self, item: PromptItem) -> PromptResult:
        loop = asyncio.get_running_loop()
        try:
            group = await self._with_retries(lambda: self.builder.build(item))
            # Only the send is repeated when the transport is full: the group is kept.
            submit = self._batcher.submit
            await self._with_retries(lambda: asyncio.wrap_future(submit(group), loop=loop))
        except Exception as e:  # noqa: BLE001 - reported back whole, with its class
            error = f"{type(e).__name__}: {e}"
            return PromptResult(item.key, ok=False, error=error, permanent=not is_retriable(e))
        return PromptResult(
            item.key, ok=True, tokens=group.num_tokens, reward_mean=float(group.rewards.mean())
        )

    async def _with_retries(self, attempt_once: Callable[[], Awaitable[T]]) -> T:
        """`attempt_once()`, tried up to `retry_attempts` times while its error is retriable."""
        attempts = max(1, self.settings.retry_attempts)
        for attempt in range(1, attempts + 1):
            try:
                return await attempt_once()
            except Exception as e:
                if attempt == attempts or not is_retriable(e):
                    raise
            await asyncio.sleep(backoff_s(self.settings, attempt))
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    async def aclose(self) -> None:
        """Close the engine clients' HTTP sessions (they belong to this event loop: left to
        the garbage collector, each says "Unclosed client session" as the process ends), then
        the sender."""
        for client in self.builder.clients:
            await client.close()
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        self._send_pool.submit(self.sender.close).result()
        self._send_pool.shutdown()

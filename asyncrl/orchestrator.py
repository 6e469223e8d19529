"""What the loop asks of the rollout side: a batch, a weight sync, the state to checkpoint.

`Orchestrator` composes what `run.py` started (the engine fleet, the dispatcher feeding the
rollout workers, the pump from the ZMQ receiver into the replay queue) and answers the loop's
three questions without hiding a thread: `take_batch` (fail loudly, never hang; heal dead
engines on the way), `sync_weights` (heal and re-sync when an engine died mid-sync), and
`state_dict` (the prompts in flight, re-issued on resume).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from asyncrl.config.schema import ModelArgs, RolloutConfig
from asyncrl.engine.fleet import EngineFleet
from asyncrl.replay.queue import DuplicateGroupError, ReplayQueue
from asyncrl.rollout.dispatch import Dispatcher
from asyncrl.transport.zmq import Receiver
from asyncrl.types import TrajectoryGroup
from asyncrl.weights.sync import WeightSource, WeightSyncError


def resolve_model(model_args: ModelArgs) -> Path:
    """The HF model directory: the configured path, or the embedded tiny model (built once)."""
    if model_args.model_name_or_path:
        path = Path(model_args.model_name_or_path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"model_name_or_path {path} is not a Hugging Face model directory"
            )
        return path
    from asyncrl.models.tiny import ensure_embedded_model

    return ensure_embedded_model()


class GroupPump:
    """A thread: ZMQ receiver → replay queue. A duplicate (a re-issued prompt delivered twice)
    is counted and dropped; a receiver failure stops the pump and is raised by `check`."""

    def __init__(self, receiver: Receiver, queue: ReplayQueue) -> None:
        self.receiver, self.queue = receiver, queue
        self.counters: Counter[str] = Counter()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="asyncrl-pump", daemon=True)

    def __enter__(self) -> GroupPump:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _pump(self) -> None:
        while not self._stop.is_set():
            try:
                group = self.receiver.get(timeout_s=0.1)
            except TimeoutError:
                continue
            except Exception as e:  # noqa: BLE001 - receiver stopped: surfaced via check()
                self.counters["receiver_failed"] += 1
                self.error = e
                return
            try:
                self.queue.put(group, prompt_key=group.metadata.get("prompt_key"))
            except DuplicateGroupError:
                self.counters["duplicate_groups"] += 1

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"transport receiver stopped: {self.error}")


class Orchestrator:
    def __init__(
        self,
        rollout: RolloutConfig,
        fleet: EngineFleet,
        dispatcher: Dispatcher,
        pump: GroupPump,
        queue: ReplayQueue,
        learner: WeightSource,
    ) -> None:
        self.rollout, self.fleet, self.dispatcher = rollout, fleet, dispatcher
        self.pump, self.queue, self.learner = pump, queue, learner

    def take_batch(self, n: int, version: int) -> list[TrajectoryGroup]:
        """Block until n groups within the staleness bound are ready; fail loudly, never hang."""
        deadline = time.monotonic() + self.rollout.request_timeout_s * 2
        while time.monotonic() < deadline:
            self.dispatcher.check()
            self.pump.check()
            self.fleet.heal(self.learner)
            groups = self.queue.take(n, version, timeout=0.5)
            if groups:
                return groups
        raise TimeoutError(
            f"no batch of {n} groups within {self.rollout.request_timeout_s * 2:.0f}s; "
            f"last rollout error: {self.dispatcher.last_error or 'none'}"
        )

    def sync_weights(self) -> dict[str, float]:
        """Broadcast the learner's weights; an engine that died mid-sync is relaunched and the
        whole fleet re-synced (heal), any other failure propagates with its engine named."""
        try:
            return self.fleet.sync(self.learner)
        except WeightSyncError:
            if not self.fleet.heal(self.learner):
                raise
            return dict(self.fleet.last_sync)

    def metrics(self) -> dict[str, float]:
        """Counters of the rollout side: queue, dispatcher, engines, receiver."""
        out = {f"replay/{k}": float(v) for k, v in self.queue.metrics().items() if "/" not in k}
        out.update(self.dispatcher.metrics())
        out.update(self.fleet.metrics())
        out.update({f"rollout/{k}": float(v) for k, v in self.pump.counters.items()})
        stats = self.pump.receiver.stats()
        out.update({"transport/received": stats.received, "transport/rejected": stats.rejected})
        return out

    # -- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The replay queue and, once, its in-flight ledger: `outstanding`, the prompts handed
        out and not delivered (as `PromptItem` dicts, pending first), re-issued on resume. One
        snapshot, so a prompt is in exactly one of buffered, outstanding or gone."""
        state = self.queue.state_dict()
        return {"outstanding": state.pop("outstanding"), "queue": state}

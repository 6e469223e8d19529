"""What the loop asks of the rollout side: a batch, a weight sync, the state to checkpoint.

`Orchestrator` composes what `run.py` started (the engine fleet, the dispatcher feeding the
rollout workers, the pump from the ZMQ receiver into the replay queue) and answers the loop's
three questions without hiding a thread: `take_batch` (fail loudly, never hang; heal dead
engines on the way), `sync_weights` (heal and re-sync when an engine died mid-sync), and
`state_dict` (the prompts in flight, re-issued on resume).

The receive side trusts nothing it has not checked: the receiver reads only connections that
proved the run's secret (ZAP), the codec decodes only well-formed groups, and the pump (`check_group`) refuses a
group whose metadata breaks asyncrl's types, whose token ids fall outside the model's
vocabulary, or whose tokens claim a policy version the learner has not reached yet. A refused
group is counted and logged in one line; the pump never dies on one.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.config.schema import ModelArgs, RolloutConfig
from asyncrl.engine.fleet import EngineFleet
from asyncrl.replay.queue import DuplicateGroupError, ReplayQueue
from asyncrl.rollout.dispatch import Dispatcher
from asyncrl.transport.zmq import Receiver
from asyncrl.types import TrajectoryGroup
from asyncrl.weights.sync import WeightSource, WeightSyncError

log = logging.getLogger(__name__)

#: How long a failed weight sync waits for the engine that broke it to be seen dead.
ENGINE_EXIT_GRACE_S = 5.0
#: The longest `open_admission` waits for the dispatcher to hand the new capacity out (a round
#: takes about a millisecond; a bound, so a stalled dispatcher never holds up the loop).
HAND_OUT_WAIT_S = 0.02


def resolve_model(model_args: ModelArgs) -> Path:
    """The HF model directory: the configured path, or the embedded tiny model (built once per
    warm-start corpus mix, `model_args.warm_start_mix`, and architecture,
    `model_args.embedded_arch`)."""
    if model_args.model_name_or_path:
        path = Path(model_args.model_name_or_path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"model_name_or_path {path} is not a Hugging Face model directory"
            )
        return path
    from asyncrl.models.tiny import embedded_spec, ensure_embedded_model

    spec = embedded_spec(model_args.warm_start_mix, model_args.embedded_arch)
    return ensure_embedded_model(spec=spec)


def model_vocab_size(model_dir: Path) -> int:
    """Rows of the model's token embedding (`config.json`'s text `vocab_size`): every token id
    the learner indexes must be below it. Not `len(tokenizer)`: engines may sample any id the
    (often padded) embedding has."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"{model_dir}/config.json has no positive vocab_size")
    return size


class GroupRejected(ValueError):
    """A received group that must not be trained on; `kind` names the check it failed."""

    def __init__(self, kind: str, group: TrajectoryGroup, problem: str) -> None:
        super().__init__(f"group {group.group_id[:80]!r}: {problem}")
        self.kind = kind


@dataclass(frozen=True)
class GroupLimits:
    """What every received group is checked against, besides its metadata types."""

    vocab_size: int
    """Token ids (prompt and response) must be below it: the model's embedding rows."""
    version: Callable[[], int]
    """The learner's current version. No token can come from a later policy: the learner
    advances before it broadcasts, so a newer version is forged or corrupt."""


# asyncrl's own metadata keys and their types; `env/<count>` keys are numbers (`multiturn.py`).
_METADATA_TYPES: dict[str, type | tuple[type, ...]] = {
    "prompt_key": str,
    "data": dict,
    "env/error": str,
}


def check_group(group: TrajectoryGroup, limits: GroupLimits | None) -> str:
    """The group's prompt key (metadata `prompt_key`, default its id) if the group may be
    trained on; GroupRejected naming the first problem otherwise. `limits` None: metadata
    types only (tests and benches without a model)."""
    for name, value in group.metadata.items():
        want = _METADATA_TYPES.get(name)
        if want is None and name.startswith("env/"):
            want = (int, float)
        if want is not None and (not isinstance(value, want) or isinstance(value, bool)):
            why = f"metadata {name!r} is a {type(value).__name__}, not {_type_name(want)}"
            raise GroupRejected("metadata", group, why)
    key = group.metadata.get("prompt_key", group.group_id)
    if not key:
        raise GroupRejected("metadata", group, "metadata 'prompt_key' is empty")
    if limits is None:
        return key
    top = max(_highest(group.prompt_ids), _highest(group.response_ids))
    if top >= limits.vocab_size:
        why = f"token id {top} is outside the vocabulary ({limits.vocab_size} ids)"
        raise GroupRejected("vocab", group, why)
    newest, current = _highest(group.versions), limits.version()
    if newest > current:
        why = f"a token claims policy version {newest}, the learner is at {current}"
        raise GroupRejected("version", group, why)
    return key


def _highest(a: np.ndarray) -> int:
    return int(np.maximum.reduce(a)) if a.size else -1


def _type_name(want: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in want) if isinstance(want, tuple) else want.__name__


class GroupPump:
    """A thread: ZMQ receiver → replay queue. Every group passes `check_group` first; a refused
    one is counted (`rejected_groups`, `rejected_groups/<check>`), logged in one line and
    dropped, and its prompt leaves the in-flight ledger (so no admission slot leaks; a retry
    would only yield the same group). A duplicate (a re-issued prompt delivered twice) is
    counted and dropped. A receiver failure or an unexpected error stops the pump and is
    raised by `check`."""

    def __init__(
        self, receiver: Receiver, queue: ReplayQueue, limits: GroupLimits | None = None
    ) -> None:
        self.receiver, self.queue, self.limits = receiver, queue, limits
        self.counters: Counter[str] = Counter()
        self.last_rejection = ""
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
                self.deliver(group)
            except Exception as e:  # noqa: BLE001 - a bug, not a bad group: fail the run
                self.counters["pump_failed"] += 1
                self.error = e
                return

    def deliver(self, group: TrajectoryGroup) -> bool:
        """Check one group and put it into the queue; False if it was refused or a duplicate."""
        try:
            key = check_group(group, self.limits)
        except GroupRejected as e:
            self._reject(group, e)
            return False
        try:
            self.queue.put(group, prompt_key=key)
        except DuplicateGroupError:
            self.counters["duplicate_groups"] += 1
            return False
        return True

    def _reject(self, group: TrajectoryGroup, e: GroupRejected) -> None:
        self.counters["rejected_groups"] += 1
        self.counters[f"rejected_groups/{e.kind}"] += 1
        self.last_rejection = str(e)
        count = self.counters["rejected_groups"]
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood cannot flood the log
            log.warning("refused received group #%d: %s", count, e)
        key = group.metadata.get("prompt_key", group.group_id)
        # Only this thread removes ledger entries, so the test and the removal cannot race.
        if isinstance(key, str) and key in self.queue.admission.ledger:
            self.queue.admission.delivered(key, accepted=False)

    def check(self) -> None:
        if self.error is not None:
            e = self.error
            raise RuntimeError(f"receive pump stopped: {type(e).__name__}: {e}") from e

    def diagnosis(self) -> str:
        """What the receive side refused lately, for a timeout's message ('' if nothing)."""
        out, stats = "", self.receiver.stats()
        if self.counters["rejected_groups"]:
            out += f"; groups refused: {self.counters['rejected_groups']}"
            out += f" (last: {self.last_rejection})"
        if stats.rejected or stats.unauthenticated:
            out += f"; messages dropped: {stats.rejected} undecodable; "
            out += f"connections refused: {stats.unauthenticated} (last: {stats.last_error})"
        return out


class Orchestrator:
    def __init__(
        self,
        rollout: RolloutConfig,
        fleet: EngineFleet,
        dispatcher: Dispatcher,
        pump: GroupPump,
        queue: ReplayQueue,
        learner: WeightSource,
        overlap: bool = False,
    ) -> None:
        """`overlap` (`weight_sync.overlap`): `sync_weights(overlap=True)` may run a sync while
        the learner trains on."""
        self.rollout, self.fleet, self.dispatcher = rollout, fleet, dispatcher
        self.pump, self.queue, self.learner = pump, queue, learner
        self.overlap = overlap
        # An overlapped sync in flight: (its future, the version it carries).
        self._pending: tuple[concurrent.futures.Future, int] | None = None
        self._landed: dict[str, float] = {}  # an overlapped sync's metrics, landed early

    def take_batch(self, n: int, version: int) -> list[TrajectoryGroup]:
        """Block until n groups within the staleness bound are ready; fail loudly, never hang."""
        deadline = time.monotonic() + self.rollout.request_timeout_s * 2
        while time.monotonic() < deadline:
            self.dispatcher.check()
            self.pump.check()
            if self._pending is not None and self._pending[0].done():
                # Landed meanwhile. Failed, its engines may be dead and no batch can come
                # until the heal its landing does: land it now, not after a batch.
                self._landed = self.land_sync()
            if self._pending is None:  # a sync in flight heals at its landing if it fails
                self.fleet.heal(self.learner)
            groups = self.queue.take(n, version, timeout=0.5)
            if groups:
                return groups
        raise TimeoutError(
            f"no batch of {n} groups within {self.rollout.request_timeout_s * 2:.0f}s; "
            f"last rollout error: {self.dispatcher.last_error or 'none'}{self.pump.diagnosis()}"
        )

    def sync_weights(self, overlap: bool = False, eval_engine: bool = True) -> dict[str, float]:
        """Broadcast the learner's weights; an engine that died mid-sync is relaunched and the
        whole fleet re-synced (heal), any other failure propagates with its engine named.
        `overlap` (where the run allows it): from a copy taken now, while the learner goes on;
        admission for its version opens when every engine holds it (`open_admission`). The
        metrics returned are those of the sync that ended here: this one, or the overlapped
        one before it ({} when none). `eval_engine` False: a dedicated evaluation engine is
        left at the version it evaluates (`EngineFleet.sync`)."""
        landed, self._landed = {**self._landed, **self.land_sync()}, {}
        if not (overlap and self.overlap):
            return self._healed(lambda: self.fleet.sync(self.learner, eval_engine))
        version = self.learner.version
        opened = lambda: self.queue.set_version(version)  # noqa: E731 - on the control loop
        future = self.fleet.start_sync(self.learner, then=opened, eval_engine=eval_engine)
        self._pending = (future, version)
        return landed

    def land_sync(self) -> dict[str, float]:
        """Wait for the overlapped sync in flight, if any (healing as `sync_weights` does)."""
        if self._pending is None:
            return {}
        (future, version), self._pending = self._pending, None
        timeout = self.fleet.ws.timeout_s * 4
        metrics = self._healed(lambda: future.result(timeout))
        self.queue.set_version(version)  # opened already, unless a heal re-synced instead
        return {**metrics, "sync/overlapped": 1.0}

    def open_admission(self, version: int) -> None:
        """Admit prompts for learner `version` (the replay queue's budget); a new version's
        prompts are handed out before it returns (the dispatcher's next round, waited for at
        most HAND_OUT_WAIT_S). An overlapped sync of that version opens it itself when it
        lands; a later version lands it first."""
        if self._pending is not None:
            if self._pending[1] == version:
                return
            self.land_sync()
        if version > self.queue.version:  # new capacity: its prompts go out first
            self.dispatcher.open_capacity(lambda: self.queue.set_version(version), HAND_OUT_WAIT_S)
        else:
            self.queue.set_version(version)

    def steer_staleness(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """With `async.max_staleness: auto`, the learner's step `metrics` move the bound
        (`ReplayQueue.observe`; {} with a fixed one). A change is printed in one line with its
        reason; `replay/staleness_change` records it."""
        decision = self.queue.observe(metrics)
        if decision is None:
            return {}
        if decision.change:
            print(f"asyncrl: step {step}: {decision.reason}")
        return {f"replay/{k}": v for k, v in decision.metrics().items()}

    def _healed(self, sync: Callable[[], dict[str, float]]) -> dict[str, float]:
        try:
            return sync()
        except WeightSyncError:
            deadline = time.monotonic() + ENGINE_EXIT_GRACE_S
            while not self.fleet.heal(self.learner):
                # An engine killed mid-sync closes its sockets before the kernel reports its
                # process gone: give a dying engine a moment to be seen dead.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
            return dict(self.fleet.last_sync)

    def metrics(self) -> dict[str, float]:
        """Counters of the rollout side: queue, dispatcher, engines, receiver."""
        out = {f"replay/{k}": float(v) for k, v in self.queue.metrics().items() if "/" not in k}
        out.update(self.dispatcher.metrics())
        out.update(self.fleet.metrics())
        out.update({f"rollout/{k}": float(v) for k, v in self.pump.counters.items()})
        stats = self.pump.receiver.stats()
        out.update({"transport/received": stats.received, "transport/rejected": stats.rejected})
        out["transport/unauthenticated"] = stats.unauthenticated
        return out

    # -- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The replay queue and, once, its in-flight ledger: `outstanding`, the prompts handed
        out and not delivered (as `PromptItem` dicts, pending first), re-issued on resume. One
        snapshot, so a prompt is in exactly one of buffered, outstanding or gone."""
        self.land_sync()  # the queue's version is the learner's: admission fully open
        state = self.queue.state_dict()
        return {"outstanding": state.pop("outstanding"), "queue": state}

"""The rollout side of the loop: engines, actors, the ZMQ intake, weight sync and evaluation.

`RolloutCluster` is what `run.py` talks to. It starts (and on failure restarts) the engine
servers and the Ray rollout actors, pumps groups from the ZMQ receiver into the replay queue,
broadcasts the learner's weights into every engine, and evaluates held-out accuracy through the
same SGLang-protocol client. Ray starts locally unless `RAY_ADDRESS` names a cluster.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.config import Config
from asyncrl.config.schema import ModelArgs
from asyncrl.replay.queue import DuplicateGroupError
from asyncrl.rollout.actor import ActorSettings, PromptItem
from asyncrl.rollout.dispatch import Dispatcher
from asyncrl.rollout.engines import EngineSet
from asyncrl.rollout.episode_metrics import episode_metrics
from asyncrl.rollout.ray_pool import RayActorPool


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


def actor_settings(
    cfg: Config, model_dir: Path, engine_urls: list[str], host: str, port: int
) -> ActorSettings:
    """The rollout actor's own sub-config, cut from the run config."""
    gen = cfg.actor_infer.generating_args
    return ActorSettings(
        engine_urls=engine_urls,
        transport_host=host,
        transport_port=port,
        tokenizer_path=str(model_dir),
        n=cfg.num_return_sequences_in_group,
        max_new_tokens=gen.max_new_tokens or cfg.response_length,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        stop_token_ids=list(gen.stop_token_ids),
        reward_fn=cfg.rollout.reward_fn,
        adv_estimator=cfg.algorithm.adv_estimator,
        norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
        overlong_buffer_len=cfg.algorithm.overlong_buffer_len,
        overlong_penalty_factor=cfg.algorithm.overlong_penalty_factor,
        request_timeout_s=cfg.rollout.request_timeout_s,
        seed=cfg.seed,
        env=cfg.env,
        max_total_tokens=cfg.response_length,
    )


class AsyncRunner:
    """An event loop in a thread, for the control plane (weight sync, health, evaluation)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class RolloutCluster:
    def __init__(
        self, cfg: Config, model_dir: Path, queue: Any, prompts: Any, learner: Any
    ) -> None:
        self.cfg, self.model_dir, self.queue, self.prompts = cfg, model_dir, queue, prompts
        self.learner = learner
        self.counters: Counter[str] = Counter()
        self._last_step_time = time.perf_counter()

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> RolloutCluster:
        from asyncrl.transport.zmq import Receiver, ReceiverConfig

        cfg = self.cfg
        self.runner = AsyncRunner()
        self.receiver = Receiver(
            ReceiverConfig(host=cfg.rollout.transport_host, port=cfg.rollout.transport_port)
        )
        self.engines = EngineSet(cfg, self.model_dir, self.runner)
        self.engines.start(self.learner)
        self.pool = RayActorPool(self._actor_settings, cfg.rollout.num_actors)
        self.dispatcher = Dispatcher(
            self.pool, self.queue, self.prompts.next_item, cfg.rollout.max_inflight_prompts
        )
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._pump_groups, name="asyncrl-pump", daemon=True)
        self._pump.start()
        self.dispatcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.queue.close()
        for closer in (
            self.dispatcher.stop,
            self.pool.close,
            self.engines.stop,
            self.receiver.close,
        ):
            try:
                closer()
            except Exception as e:  # noqa: BLE001 - shutdown is best effort, report and go on
                print(f"asyncrl: shutdown: {type(e).__name__}: {e}")
        self._pump.join(timeout=5)
        self.runner.close()

    def _actor_settings(self, index: int) -> ActorSettings:
        urls = self.engines.urls_for_actor(index, self.cfg.rollout.num_actors)
        return actor_settings(
            self.cfg, self.model_dir, urls, self.receiver_host(), self.receiver.port
        )

    def receiver_host(self) -> str:
        host = self.cfg.rollout.transport_host
        return "127.0.0.1" if host in ("0.0.0.0", "*") else host

    def _pump_groups(self) -> None:
        """Receiver → replay queue. A duplicate (a re-issued prompt delivered twice) is counted."""
        while not self._stop.is_set():
            try:
                group = self.receiver.get(timeout_s=0.1)
            except TimeoutError:
                continue
            except Exception as e:  # noqa: BLE001 - receiver stopped: surfaced via take_batch
                self.counters["receiver_failed"] += 1
                self._receiver_error = e
                return
            try:
                self.queue.put(group, prompt_key=group.metadata.get("prompt_key"))
            except DuplicateGroupError:
                self.counters["duplicate_groups"] += 1

    # -- what the loop calls -----------------------------------------------------------------
    def restore(self, items: list[dict[str, Any]]) -> None:
        self.dispatcher.restore([PromptItem(**it) for it in items])

    def take_batch(self, n: int, version: int) -> list[Any]:
        """Block until n groups within the staleness bound are ready; fail loudly, never hang."""
        deadline = time.monotonic() + self.cfg.rollout.request_timeout_s * 2
        while time.monotonic() < deadline:
            self.dispatcher.check()
            if getattr(self, "_receiver_error", None) is not None:
                raise RuntimeError(f"transport receiver stopped: {self._receiver_error}")
            self.engines.heal(self.learner)
            groups = self.queue.take(n, version, timeout=0.5)
            if groups:
                return groups
        raise TimeoutError(
            f"no batch of {n} groups within {self.cfg.rollout.request_timeout_s * 2:.0f}s; "
            f"last rollout error: {self.dispatcher.last_error or 'none'}"
        )

    def sync_weights(self, learner: Any) -> dict[str, float]:
        """Broadcast the learner's weights; an engine that died mid-sync is relaunched and the
        whole fleet re-synced (heal), any other failure propagates with its engine named."""
        from asyncrl.weights.sync import WeightSyncError

        try:
            return self.engines.sync(learner)
        except WeightSyncError:
            if not self.engines.heal(learner):
                raise
            return dict(self.engines.last_sync)

    def record_trained(self, step: int, groups: list[Any]) -> None:
        """Append the trained group ids (the audit trail that no group is lost or repeated)."""
        with open(Path(self.cfg.output_dir) / "trained_groups.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "ids": [g.group_id for g in groups]}) + "\n")

    def batch_metrics(
        self, groups: list[Any], version: int, idle: float, waited: float
    ) -> dict[str, float]:
        now = time.perf_counter()
        elapsed, self._last_step_time = now - self._last_step_time, now
        lags = [version - 1 - g.min_version() for g in groups]  # staleness when trained on
        tokens = sum(g.num_tokens for g in groups)
        rewards = np.concatenate([g.rewards for g in groups])
        versions = [g.max_version() for g in groups]
        out = {
            "version": float(version),
            "rollout/policy_version_min": float(min(g.min_version() for g in groups)),
            "rollout/policy_version_max": float(max(versions)),
            "rollout/reward_mean": float(rewards.mean()),
            "rollout/response_length_mean": tokens / max(1, sum(g.n for g in groups)),
            "replay/staleness_mean": float(np.mean(lags)),
            "replay/staleness_max": float(max(lags)),
            "throughput/tokens_per_s": tokens / max(elapsed, 1e-9),
            "learner/idle_frac": idle / max(elapsed, 1e-9),
            "learner/wait_seconds": idle,
        }
        for lag, count in Counter(lags).items():
            out[f"replay/staleness_hist/{lag}"] = float(count)
        out.update(
            {f"replay/{k}": float(v) for k, v in self.queue.metrics().items() if "/" not in k}
        )
        out.update(self.dispatcher.metrics())
        out.update(self.engines.metrics())
        out.update({f"rollout/{k}": float(v) for k, v in self.counters.items()})
        out.update(episode_metrics(groups))
        stats = self.receiver.stats()
        out.update({"transport/received": stats.received, "transport/rejected": stats.rejected})
        return out

    def evaluate(self, step: int, version: int) -> dict[str, float]:
        interval = self.cfg.logging.eval_interval
        if interval <= 0 or (step % interval and step != self.cfg.max_steps):
            return {}
        from asyncrl.rollout.client import EngineError

        items = self.prompts.heldout_items(self.cfg.logging.eval_size)
        for attempt in range(2):
            self.engines.heal(self.learner)
            try:
                return self.engines.evaluate(items)
            except EngineError as e:  # an engine died under the evaluation: heal, try again
                self.counters["eval_failures"] += 1
                if attempt:
                    print(f"asyncrl: evaluation skipped at step {step}: {e}")
        return {}

    def extra_state(self, prompts: Any, step: int) -> dict[str, Any]:
        outstanding = [vars(item) for item in self.dispatcher.outstanding()]
        return {
            "prompts": prompts.state_dict(),
            "queue": self.queue.state_dict(),
            "outstanding": outstanding,
            "version": self.learner.version,
        }

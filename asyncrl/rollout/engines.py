"""The engine fleet: launch, weight-update group, sync, self-healing, evaluation.

`hf_infer` engines are asyncrl's own server processes (one per engine, loopback); `sglang`
engines arrive with the production backends. Either way the fleet is driven through the same
SGLang-protocol client. An engine whose process dies is relaunched, the update group is formed
again with every engine, and the current weights are pushed before it serves again.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.rollout.actor import PromptItem


class EngineSet:
    def __init__(self, cfg: Config, model_dir: Path, runner: Any) -> None:
        self.cfg, self.model_dir, self.runner = cfg, model_dir, runner
        from asyncrl.rollout.launchers import make_launcher

        self.handles: list[Any] = []
        self.clients: list[Any] = []
        self.counters: Counter[str] = Counter()
        self.last_sync: dict[str, float] = {}
        self.backend = "gloo"  # of the weight-update group; resolved by `_init_group`
        self.log_dir = Path(cfg.output_dir) / "engine_logs"
        # hf_infer or sglang (asyncrl.rollout.launchers): engines, their tp size and device.
        self.launcher = make_launcher(cfg.actor_infer, model_dir, self.log_dir, cfg.seed)
        self.num_engines = self.launcher.num_engines

    # -- processes ---------------------------------------------------------------------------
    def _launch(self, index: int, port: int | None = None) -> Any:
        return self.launcher.launch(index, port)

    def start(self, learner: Any) -> None:
        from asyncrl.rollout.client import EngineClient
        from asyncrl.weights.sync import WeightSender

        self.handles = [self._launch(i) for i in range(self.num_engines)]
        timeout = self.cfg.rollout.request_timeout_s
        self.clients = [self._client(EngineClient, h.url, timeout) for h in self.handles]
        self.sender = WeightSender(timeout_s=self.cfg.weight_sync.timeout_s)
        self._init_group()
        self.sync(learner)

    def _client(self, cls: Any, url: str, timeout: float) -> Any:
        async def make() -> Any:
            return cls(url, timeout=timeout)

        return self.runner.run(make())

    def _init_group(self) -> None:
        from asyncrl.device import resolve_backend

        ws = self.cfg.weight_sync
        backend = resolve_backend(ws.backend, self.launcher.device)  # auto: nccl|hccl|gloo
        self.backend = backend
        tp_sizes = [self.launcher.tp_size] * len(self.clients)  # engine i joins at 1 + i*tp
        args = (self.clients, ws.master_address, ws.master_port or None, backend, ws.timeout_s)
        self.runner.run(
            self.sender.init_group(*args, tp_sizes=tp_sizes),
            timeout=ws.timeout_s + 30,
        )

    def urls_for_actor(self, index: int, num_actors: int) -> list[str]:
        """Every actor may use every engine; actors start on different ones. With a router
        (sglang, several engines) every actor generates through the router."""
        urls = self.launcher.actor_urls([h.url for h in self.handles])
        shift = index % len(urls)
        return urls[shift:] + urls[:shift]

    def heal(self, learner: Any) -> bool:
        """Relaunch dead engine processes and bring them to the learner's weights; True if any
        engine was relaunched."""
        dead = [i for i, h in enumerate(self.handles) if h.proc.poll() is not None]
        if not dead:
            return False
        for i in dead:
            # Same port, so actors keep their URLs; their failed prompts are re-issued.
            port = int(self.handles[i].url.rsplit(":", 1)[1])
            self.handles[i] = self._launch(i, port)
            self.counters["engine_restarts"] += 1
            print(f"asyncrl: engine {i} died; relaunched at {self.handles[i].url}")
        self._init_group()
        self.sync(learner)
        return True

    def stop(self) -> None:
        try:
            self.runner.run(self.sender.close(), timeout=30)
        except Exception:  # noqa: BLE001 - engines may be gone already
            pass
        for client in self.clients:
            self.runner.run(client.close(), timeout=10)
        for handle in self.handles:
            handle.stop()
        self.launcher.close()

    # -- weights -----------------------------------------------------------------------------
    def sync(self, learner: Any) -> dict[str, float]:
        import torch

        ws, infer = self.cfg.weight_sync, self.cfg.actor_infer
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(infer.model_args.dtype or "")
        stats = self.runner.run(
            self.sender.sync(
                learner.weights_for_sync(),
                learner.version,
                bucket_bytes=int(ws.bucket_size_mb * 1024**2),
                load_format=self._load_format(),
                pause_mode=self.cfg.async_.pause_mode,
                dtype=dtype,
            ),
            timeout=ws.timeout_s * 4,
        )
        self.counters["syncs"] += 1
        self.last_sync = {
            "sync/seconds": stats.seconds,
            "sync/gb_per_s": stats.gb_per_s,
            "sync/buckets": float(stats.buckets),
        }
        return dict(self.last_sync)

    def _load_format(self) -> str | None:
        fmt = self.cfg.weight_sync.load_format
        if fmt == "auto":  # see WeightSyncConfig.load_format
            return "auto" if self.backend == "gloo" else "flattened_bucket"
        return "flattened_bucket" if fmt == "flattened_bucket" else None

    def metrics(self) -> dict[str, float]:
        return {f"engines/{k}": float(v) for k, v in self.counters.items()}

    # -- evaluation --------------------------------------------------------------------------
    def evaluate(self, items: list[PromptItem]) -> dict[str, float]:
        """Greedy held-out accuracy through the engines (the weights they serve right now)."""
        if not items:
            return {}
        start = time.perf_counter()
        rewards = self.runner.run(self._eval(items), timeout=self.cfg.rollout.request_timeout_s * 2)
        return {
            "eval/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "eval/reward_mean": sum(rewards) / len(rewards),
            "eval/seconds": time.perf_counter() - start,
        }

    async def _eval(self, items: list[PromptItem]) -> list[float]:
        from transformers import AutoTokenizer

        from asyncrl.rewards import get_reward_fn

        if not hasattr(self, "_tokenizer"):
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            self._reward = get_reward_fn(self.cfg.rollout.reward_fn)
        gen = self.cfg.actor_infer.generating_args
        params = {
            "max_new_tokens": gen.max_new_tokens or self.cfg.response_length,
            "temperature": 0.0,
        }
        requests = [
            (
                self.clients[i % len(self.clients)],
                {"input_ids": it.prompt_ids, "sampling_params": params},
            )
            for i, it in enumerate(items)
        ]
        outs = await asyncio.gather(*(c.generate_one(r) for c, r in requests))
        texts = [self._tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
        return [
            float(self._reward(it.prompt_text, text, it.metadata))
            for it, text in zip(items, texts, strict=True)
        ]

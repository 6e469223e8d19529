"""SGLang's native LoRA path (`weight_sync.lora_sync: native`): adapters by name, not tensors.

SGLang serves many LoRA adapters over one frozen base and picks one per request (`lora_path`
on /generate names it). A sync therefore moves no weights through the update group:

1. the adapter is written once, in PEFT format (`adapter_config.json` +
   `adapter_model.safetensors`, what `PeftModel.save_pretrained` writes), to
   `lora_dir/asyncrl-v{version}`, a directory every engine can read;
2. every engine loads it under that name (`/load_lora_adapter`) unless it has it already (a
   relaunched engine has none); a refused load fails the sync naming the engine, and no engine
   has switched: each keeps serving the previous adapter, nothing is lost;
3. only when all engines hold it, each reports the new version (`/update_weight_version`);
   rollout clients (`EngineClient`) see it in their replies and name the new adapter from
   then on. With `async.pause_mode: abort` that call also aborts the requests in flight (they
   are continued under the new adapter, as after a full sync); `in_place` and `retract` hold
   nothing: a request runs wholly on the adapter it named, so there is nothing to hold;
4. the directories of older versions are removed (an engine reads an adapter once, at load),
   so SGLang's implicit reload of an unloaded name fails instead of reviving stale weights;
   every other `asyncrl-v*` adapter is unloaded in the background: SGLang stops new requests
   naming it at once and frees it when the requests running on it have finished (so they
   finish on the adapter they started with). The next sync first waits for these unloads
   (SGLang serialises adapter loads behind them anyway). A request a client sends before it
   has seen the new version still names the previous adapter: it runs on it and is stamped
   with it, or, if already unloaded, is refused and retried on the new one by the client.

The written adapter holds exactly the tensors the engines would get by `lora_sync: adapter`
(`Learner.adapter_for_sync`: per layer A and scaling·B), with `lora_alpha = r` so SGLang's
scaling (alpha / r, it has no rsLoRA) is 1: the served policy is the learner's, rsLoRA included.
Never pickle: SGLang 0.5.23's load-from-tensors endpoint unpickles its payload, so it is unused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from asyncrl.weights.buckets import LORA_A, LORA_B, tensor_nbytes
from asyncrl.weights.lora_names import PREFIX, adapter_name, adapter_version
from asyncrl.weights.sync import SyncStats, WeightSyncError, _describe

__all__ = ["LoraTarget", "NativeLora", "NativeLoraSync", "native_lora", "write_adapter"]
log = logging.getLogger(__name__)
#: peft's prefix of a base model's parameter names in a saved adapter.
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class NativeLora:
    """What a run with `lora_sync: native` needs: the engines' LoRA flags and the adapter dir."""

    rank: int
    target_modules: str | list[str]  # peft's: "all-linear" or module names
    lora_dir: Path


def native_lora(weight_sync: Any, model_args: Any, output_dir: str) -> NativeLora | None:
    """`weight_sync.lora_sync: native` of a LoRA run (`cfg.weight_sync`,
    `cfg.actor_train.model_args`, `cfg.output_dir`), resolved; None when it is not one."""
    if weight_sync.lora_sync != "native" or model_args.lora_rank <= 0:
        return None
    lora_dir = weight_sync.lora_dir.strip() or Path(output_dir) / "lora_adapters"
    return NativeLora(model_args.lora_rank, model_args.target_modules, Path(lora_dir).resolve())


class LoraTarget(Protocol):
    """An engine as the native sync sees it (`EngineClient`'s LoRA calls). A failed call raises;
    one with a `problem` attribute (the engine client's) is reported by it."""

    url: str

    async def lora_adapters(self) -> list[str]:
        """The names of the adapters the engine has loaded."""

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None: ...

    async def unload_lora_adapter(self, lora_name: str) -> None: ...

    async def update_weight_version(
        self, version: int | str, abort_all_requests: bool = False
    ) -> object: ...


@dataclass(frozen=True)
class WrittenAdapter:
    path: Path
    bytes: int
    tensors: int
    rank: int


def write_adapter(tensors: Iterable[tuple[str, torch.Tensor]], path: Path) -> WrittenAdapter:
    """Write `adapter_for_sync`'s tensors (HF names `<module>.lora_A.weight` [r, in] and
    `<module>.lora_B.weight` [out, r], scaling folded into B) as a PEFT adapter directory.
    Written beside `path` and renamed into place, so an engine never reads half an adapter."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    state: dict[str, torch.Tensor] = {}
    ranks, modules = set(), set()
    for name, tensor in tensors:
        module, half = _split(name)
        state[PEFT_PREFIX + name] = tensor.detach().to("cpu").contiguous()
        ranks.add(tensor.shape[0] if half == LORA_A else tensor.shape[1])
        modules.add(module.rsplit(".", 1)[-1])
    if not state:
        raise WeightSyncError(f"no adapter tensors to write to {path}")
    if len(ranks) != 1:
        raise WeightSyncError(f"adapter tensors disagree on the LoRA rank: {sorted(ranks)}")
    rank = ranks.pop()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # lora_alpha = r: SGLang scales by alpha / r, and scaling is already folded into B.
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=sorted(modules), bias="none")
    config.save_pretrained(str(tmp))
    save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    nbytes = sum(tensor_nbytes(t) for t in state.values())
    return WrittenAdapter(path, nbytes, len(state), rank)


def _split(name: str) -> tuple[str, str]:
    for half in (LORA_A, LORA_B):
        if name.endswith("." + half):
            return name[: -len(half) - 1], half
    raise WeightSyncError(f"{name!r} is not a LoRA adapter tensor (…{LORA_A} or …{LORA_B})")


class NativeLoraSync:
    """Writes each version's adapter under `lora_dir` and switches every engine to it (see the
    module docstring). `timeout_s` bounds every engine call and the wait for old unloads."""

    def __init__(self, lora_dir: Path, timeout_s: float = 120.0) -> None:
        self.lora_dir = Path(lora_dir).resolve()
        self.timeout_s = timeout_s
        self._unloads: list[asyncio.Task] = []

    async def sync(
        self,
        engines: Sequence[LoraTarget],
        tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        pause_mode: str | None = None,
    ) -> SyncStats:
        """Make `engines` serve `tensors` as adapter `asyncrl-v{version}`; WeightSyncError (one
        line naming the engine) when an engine refuses, with no engine switched."""
        start = time.perf_counter()
        await self.drain()
        name = adapter_name(version)
        # off the event loop: health checks and evaluation share it; the learner waits meanwhile
        written = await asyncio.to_thread(write_adapter, tensors, self.lora_dir / name)
        loaded = await self._each(engines, lambda e: self._load(e, name, written.path), "load")
        abort = pause_mode == "abort"  # the only mode that changes what runs: see the docstring
        await self._each(
            engines, lambda e: e.update_weight_version(version, abort), "update_weight_version"
        )
        stale = {n for names in loaded for n in names if adapter_version(n) is not None} - {name}
        for old in self.lora_dir.glob(f"{PREFIX}*"):
            if old.name != name and adapter_version(old.name) is not None:
                shutil.rmtree(old, ignore_errors=True)
        if stale:
            task = asyncio.ensure_future(self._unload(engines, loaded, sorted(stale)))
            self._unloads.append(task)
        secs = time.perf_counter() - start
        rate = written.bytes / max(secs, 1e-9) / 1e9
        return SyncStats(version, secs, written.bytes, rate, 1, written.tensors)

    async def drain(self) -> None:
        """Wait for the background unloads of earlier syncs (bounded by `timeout_s`)."""
        tasks, self._unloads = self._unloads, []
        if not tasks:
            return
        done, pending = await asyncio.wait(tasks, timeout=self.timeout_s)
        for task in pending:
            task.cancel()
            log.warning("asyncrl: LoRA unload still waiting after %gs; left behind", self.timeout_s)

    async def close(self) -> None:
        """Drop the background unloads still waiting (the engines are going away)."""
        tasks, self._unloads = self._unloads, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _load(self, engine: LoraTarget, name: str, path: Path) -> list[str]:
        """The engine's adapters before this sync; loads `name` unless it is among them."""
        have = list(await engine.lora_adapters())
        if name not in have:
            await engine.load_lora_adapter(name, str(path))
        return have

    async def _unload(self, engines: Sequence[LoraTarget], loaded: list, names: list) -> None:
        """Unload `names` wherever they were loaded (a failure leaves one lingering: the next
        sync finds it listed and unloads it again)."""

        async def one(engine: LoraTarget, have: list[str]) -> None:
            for n in (n for n in names if n in have):
                try:
                    await engine.unload_lora_adapter(n)
                except Exception as exc:  # noqa: BLE001 - an old adapter lingers; not fatal
                    log.warning("asyncrl: unload of %s on %s: %s", n, engine.url, _describe(exc))

        await asyncio.gather(*(one(e, have) for e, have in zip(engines, loaded)))

    async def _each(self, engines: Sequence[LoraTarget], call, what: str) -> list:
        async def one(engine: LoraTarget):
            try:
                return await asyncio.wait_for(call(engine), self.timeout_s)
            except TimeoutError:
                raise WeightSyncError(
                    f"LoRA {what} failed on engine {engine.url}: no reply within "
                    f"{self.timeout_s:g}s"
                ) from None
            except WeightSyncError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure of the engine, named
                raise WeightSyncError(
                    f"LoRA {what} failed on engine {engine.url}: {_describe(exc)}"
                ) from None

        return list(await asyncio.gather(*(one(e) for e in engines)))

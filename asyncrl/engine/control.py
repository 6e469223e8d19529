"""`EngineControl`, which `EngineClient` extends: an engine's control calls over SGLang's native
HTTP protocol -- pause, continue, cache flush, health, server info -- and its weight updates.

Weight updates follow the engine's reported version (`engine/versions.py`): `prepare_update`
pauses, waits until a flush is accepted where the pause mode empties the engine, and opens a
weight-update session where one is required; `finish_update` closes it, sets the version where
the bucket's own is lost, and continues. Native LoRA (`weights/lora_native.py`) loads and
unloads adapters by name here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asyncrl.engine.http import EngineHTTP
from asyncrl.engine.replies import EngineError, EngineReplyError, one_line
from asyncrl.engine.versions import EngineProfile, profile_for, seed_warning

#: How often `prepare_update` asks for a cache flush while the engine drains.
FLUSH_POLL_S = 0.2

log = logging.getLogger(__name__)


class EngineControl:
    """`EngineClient`'s control and weight-update methods, over the attributes its constructor
    sets."""

    url: str
    http: EngineHTTP
    seen_version: int | None  # newest weight version in this engine's replies
    _profile: EngineProfile | None

    async def pause(self, mode: str = "abort") -> None:
        await self.http.call_ok("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self.http.call_ok("POST", "/continue_generation", {})

    async def flush_cache(self) -> bool:
        """True if flushed; False when the engine refuses (requests still running)."""
        status, data = await self.http.call("POST", "/flush_cache")
        if status not in (200, 400):
            problem = f"/flush_cache answered HTTP {status}: {one_line(data)}"
            raise EngineError(self.url, problem, status)
        return status == 200

    async def profile(self) -> EngineProfile:
        """The engine's weight-sync profile, from the version `/server_info` reports (older
        servers: `/get_server_info`); asked once per client (a relaunch gets a new client)."""
        if self._profile is None:
            status, data = await self.http.call("GET", "/server_info")
            if status != 200:
                data = await self.http.call_ok("GET", "/get_server_info")
            if not isinstance(data, dict) or not isinstance(data.get("version"), str):
                raise EngineReplyError(self.url, f"server info has no version: {one_line(data)}")
            self._profile = profile_for(data["version"], data)
            if warning := seed_warning(data, self.url):
                log.warning("%s", warning)
        return self._profile

    async def server_info(self) -> dict[str, Any]:
        """The engine's /server_info, as it answers now (asyncrl's hf server adds its pauses by
        mode and the weight buckets it received by load_format)."""
        data = await self.http.call_ok("GET", "/server_info")
        if not isinstance(data, dict):
            raise EngineReplyError(self.url, f"server info is not an object: {one_line(data)}")
        return data

    async def begin_weight_update(self) -> str:
        return await self.http.call_success("/begin_weight_update", {}, None)

    async def end_weight_update(self) -> str:
        return await self.http.call_success("/end_weight_update", {}, None)

    async def prepare_update(self, pause_mode: str | None, timeout_s: float) -> None:
        """Before the buckets: pause (unless None); flush once the engine is idle, where the
        pause mode lets it become idle (never in in_place: its paused requests keep their KV,
        and the cache namespace keeps it apart); open the weight-update session if required."""
        profile = await self.profile()
        if pause_mode:
            await self.pause(pause_mode)
        if pause_mode in profile.flush_modes:
            await self._flush_when_idle(timeout_s)
        if profile.session:
            try:
                await self.begin_weight_update()
            except EngineError as e:
                if "already open" not in e.problem:
                    raise
                # left open by a sync that failed half-way: close it, then start afresh
                await self.end_weight_update()
                await self.begin_weight_update()

    async def finish_update(self, version: int, pause_mode: str | None) -> None:
        """After the last bucket: close the session, make sure the engine reports `version`
        (0.5.6 drops the last bucket's version while paused), then continue (if paused)."""
        profile = await self.profile()
        if profile.session:
            await self.end_weight_update()
        if profile.explicit_version:
            await self.update_weight_version(version)
        self.saw_version(version)  # this client's next request starts under it: its namespace
        if pause_mode:
            await self.resume()

    def saw_version(self, version: int | None) -> None:
        """The engine holds weight `version` (or a newer one): requests from now on use its
        cache namespace. Told by whoever knows, before a reply shows it: the syncing client,
        and rollout workers from the version stamped on each prompt (`PromptItem`)."""
        if version is not None:
            self.seen_version = max(self.seen_version or 0, version)

    async def _flush_when_idle(self, timeout_s: float) -> None:
        """Poll /flush_cache until accepted (slime's way): an abort/retract pause returns before
        the scheduler has let go of every request."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.flush_cache():
            if loop.time() >= deadline:
                raise EngineError(self.url, f"/flush_cache refused for {timeout_s:g}s while paused")
            await asyncio.sleep(FLUSH_POLL_S)

    async def health(self, timeout_s: float | None = None) -> bool:
        """True iff /health_generate answers 200 within `timeout_s` (default: the control
        timeout); never raises for a down, hung or unhealthy engine."""
        try:
            status, _ = await self.http.call("GET", "/health_generate", timeout_s=timeout_s)
        except EngineError:
            return False
        return status == 200

    async def update_weight_version(
        self, version: int | str, abort_all_requests: bool = False
    ) -> str:
        body = {"new_version": str(version), "abort_all_requests": abort_all_requests}
        return await self.http.call_success("/update_weight_version", body, None)

    # ---- weight updates --------------------------------------------------------------------
    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float | None = None,
    ) -> str:
        await self.profile()  # the engine's sync steps are known before the first sync
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self.http.call_success("/init_weights_update_group", body, timeout_s)

    async def update_weights(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: int | str | None = None,
        load_format: str | None = None,
        group_name: str = "weight_update_group",
        flush_cache: bool = False,
        timeout_s: float | None = None,
    ) -> str:
        """POST /update_weights_from_distributed; the tensors then arrive by broadcast(src=0)."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "weight_version": None if weight_version is None else str(weight_version),
            "load_format": load_format,
        }
        return await self.http.call_success("/update_weights_from_distributed", body, timeout_s)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> str:
        body = {"group_name": group_name}
        return await self.http.call_success("/destroy_weights_update_group", body, None)

    # ---- LoRA adapters (SGLang's native path; needs an engine launched with --enable-lora) ----
    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> None:
        """The engine loads the PEFT adapter directory `lora_path` (on its host) as `lora_name`."""
        body = {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}
        await self.http.call_success("/load_lora_adapter", body, None, "error_message")

    async def unload_lora_adapter(self, lora_name: str) -> None:
        body = {"lora_name": lora_name}
        await self.http.call_success("/unload_lora_adapter", body, None, "error_message")

    async def lora_adapters(self) -> list[str]:
        """The adapters in `/v1/models` (entries with a `parent`); [] without it (hf engine)."""
        status, data = await self.http.call("GET", "/v1/models")
        if status != 200:
            return []
        cards = data.get("data") if isinstance(data, dict) else None
        if not isinstance(cards, list):
            raise EngineReplyError(self.url, f"/v1/models reply lacks data: {one_line(data)}")
        return [str(c.get("id")) for c in cards if isinstance(c, dict) and c.get("parent")]

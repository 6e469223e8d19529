"""One engine server's HTTP transport: a session per event loop, a timeout on every call, and
errors that name the engine URL (`EngineError`, `EngineTimeoutError`, `EngineReplyError`).

Kept apart from `client.py`, which says what asyncrl asks of an engine (generation, weight
updates, LoRA adapters); this says only how a call reaches it and how a reply comes back.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from asyncrl.engine.replies import EngineError, EngineReplyError, EngineTimeoutError, one_line


class EngineHTTP:
    """Calls to `url`. `control_timeout` (s) bounds a call that names none; `headers` go on
    every call (the engine's shared secret). The aiohttp session belongs to the event loop that
    made it: a call from another loop (a rollout worker's next one) gets a new session."""

    def __init__(
        self, url: str, headers: dict[str, str], control_timeout: float, max_connections: int
    ) -> None:
        self.url = url
        self.control_timeout = control_timeout
        self._headers = headers
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            connector = aiohttp.TCPConnector(limit=self._max_connections)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
            self._loop = loop
        return self._session

    async def call(
        self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None
    ) -> tuple[int, object]:
        """(HTTP status, parsed JSON or text). Raises EngineError / EngineTimeoutError."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.control_timeout)
        try:
            async with self._get_session().request(
                method, self.url + path, json=body, timeout=timeout
            ) as resp:
                text = await resp.text()
                status = resp.status
        except TimeoutError:
            raise EngineTimeoutError(
                self.url, f"{path} gave no reply within {timeout.total:.0f}s"
            ) from None
        except aiohttp.ClientError as e:
            raise EngineError(self.url, f"{path} failed: {type(e).__name__}: {e}") from None
        try:
            return status, json.loads(text) if text.strip() else None
        except ValueError:
            return status, text

    async def call_ok(self, method: str, path: str, body=None, timeout_s=None) -> object:
        """`call`'s reply data; EngineError (with the status) unless HTTP 200."""
        status, data = await self.call(method, path, body, timeout_s)
        if status != 200:
            problem = f"{path} answered HTTP {status}: {one_line(data)}"
            raise EngineError(self.url, problem, status)
        return data

    async def call_success(
        self, path: str, body: dict, timeout_s: float | None, message: str = "message"
    ) -> str:
        """For SGLang's `{"success", <message>}` endpoints (`error_message` in the LoRA ones'
        `LoRAUpdateOutput`): the message, or EngineError."""
        _, data = await self.call("POST", path, body, timeout_s)
        if not isinstance(data, dict) or not isinstance(data.get("success"), bool):
            raise EngineReplyError(self.url, f"{path} reply lacks success: {one_line(data)}")
        if not data["success"]:
            raise EngineError(self.url, f"{path} failed: {one_line(data.get(message))}")
        return str(data.get(message) or "")

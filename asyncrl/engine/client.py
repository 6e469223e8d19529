"""EngineClient: SGLang's native HTTP protocol, one engine URL, async (aiohttp).

The same code drives a real SGLang server and asyncrl's hf server. Every call has a timeout;
every reply is checked before it is trusted: a malformed reply raises `EngineReplyError` naming
the engine URL and what is wrong, never a KeyError deep in the orchestrator.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

FINISH_TYPES = ("stop", "length", "abort")


class EngineError(RuntimeError):
    """An engine call failed (connection, HTTP status, or an explicit `success: false`)."""

    def __init__(self, url: str, problem: str) -> None:
        super().__init__(f"engine {url}: {problem}")
        self.url = url
        self.problem = problem


class EngineReplyError(EngineError):
    """The engine answered, but the reply breaks the protocol."""


class EngineTimeoutError(EngineError):
    """The engine did not answer within the call's timeout."""


@dataclass(frozen=True)
class GenerateRequest:
    input_ids: list[int]
    sampling_params: dict = field(default_factory=dict)
    rid: str | None = None
    return_logprob: bool = True


@dataclass(frozen=True)
class Completion:
    output_ids: list[int]
    output_logprobs: list[float]  # empty when return_logprob was False
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str  # as the engine reports it (SGLang versions are strings)
    prompt_tokens: int
    rid: str = ""
    output_token_versions: list[str] | None = None  # asyncrl's hf server only

    @property
    def version(self) -> int | None:
        """`weight_version` as an int: asyncrl sends ints; SGLang's initial "default" is 0."""
        if self.weight_version == "default":
            return 0
        try:
            return int(self.weight_version)
        except ValueError:
            return None

    def token_versions(self) -> list[int]:
        """The policy version of every output token.

        asyncrl's hf server reports the version that sampled each token. SGLang reports one
        version per request (the one current when it finished), so every token gets it; tokens
        sampled before an in-place/retract weight update are then labelled with the newer
        version (their logprobs are still the sampling policy's own).
        """
        if self.output_token_versions is not None:
            return [_as_version(v) for v in self.output_token_versions]
        if self.version is None:
            raise ValueError(f"weight_version {self.weight_version!r} is not an integer version")
        return [self.version] * len(self.output_ids)


def parse_completion(url: str, obj: object, want_logprob: bool) -> Completion:
    """Check one /generate reply item and turn it into a Completion."""

    def bad(problem: str) -> EngineReplyError:
        return EngineReplyError(url, f"malformed /generate reply: {problem}")

    if not isinstance(obj, dict):
        raise bad(f"expected an object, got {type(obj).__name__}")
    meta = obj.get("meta_info")
    if not isinstance(meta, dict):
        raise bad("missing meta_info")
    out = obj.get("output_ids")
    if not isinstance(out, list) or not all(_is_int(t) for t in out):
        raise bad("output_ids missing or not a list of ints")
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in FINISH_TYPES:
        raise bad(f"finish_reason {finish!r} is not {{'type': stop|length|abort}}")
    if "weight_version" not in meta:
        raise bad("meta_info has no weight_version (SGLang older than 0.5?)")
    prompt_tokens = meta.get("prompt_tokens")
    if not _is_int(prompt_tokens):
        raise bad("meta_info.prompt_tokens missing or not an int")
    logprobs: list[float] = []
    if want_logprob:
        logprobs = _parse_logprobs(meta.get("output_token_logprobs"), out, bad)
    versions = meta.get("output_token_weight_versions")
    if versions is not None and (not isinstance(versions, list) or len(versions) != len(out)):
        raise bad("output_token_weight_versions is not one version per output token")
    if versions is not None and not all(_is_version(v) for v in versions):
        raise bad("output_token_weight_versions holds a non-integer version")
    return Completion(
        output_ids=out,
        output_logprobs=logprobs,
        finish_reason=finish["type"],
        weight_version=str(meta["weight_version"]),
        prompt_tokens=prompt_tokens,
        rid=str(meta.get("id", "")),
        output_token_versions=[str(v) for v in versions] if versions is not None else None,
    )


def _is_version(v: object) -> bool:
    return v == "default" or _is_int(v) or (isinstance(v, str) and v.lstrip("-").isdigit())


def _as_version(v: str) -> int:
    """SGLang's initial "default" counts as version 0."""
    return 0 if v == "default" else int(v)


def _parse_logprobs(entries: object, out: list[int], bad) -> list[float]:
    if not isinstance(entries, list):
        raise bad("return_logprob was set but output_token_logprobs is missing")
    if len(entries) != len(out):
        raise bad(f"{len(entries)} output_token_logprobs for {len(out)} output tokens")
    lps = []
    for i, e in enumerate(entries):
        if not isinstance(e, list | tuple) or len(e) < 2:
            raise bad(f"output_token_logprobs[{i}] is not (logprob, token_id, text)")
        lp, tok = e[0], e[1]
        if not isinstance(lp, int | float) or isinstance(lp, bool) or not math.isfinite(lp):
            raise bad(f"non-finite logprob {lp!r} at output position {i}")
        if tok != out[i]:
            raise bad(f"output_token_logprobs[{i}] is for token {tok!r}, output has {out[i]}")
        lps.append(float(lp))
    return lps


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class EngineClient:
    """One engine server. `timeout` (s) bounds generate calls, `control_timeout` the rest.

    `api_key`: the engine's shared secret (SGLang's `--api-key`), sent on every call as
    `Authorization: Bearer <api_key>`; None sends no header (an engine without a key)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 600.0,
        control_timeout: float = 60.0,
        max_connections: int = 256,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.control_timeout = control_timeout
        self._max_connections = max_connections
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"EngineClient({self.url!r})"

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

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

    async def _call(
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

    async def _call_ok(self, method: str, path: str, body=None, timeout_s=None) -> object:
        status, data = await self._call(method, path, body, timeout_s)
        if status != 200:
            raise EngineError(self.url, f"{path} answered HTTP {status}: {_one_line(data)}")
        return data

    async def _call_success(self, path: str, body: dict, timeout_s: float | None) -> str:
        """For SGLang's `{"success", "message"}` endpoints: the message, or EngineError."""
        _, data = await self._call("POST", path, body, timeout_s)
        if not isinstance(data, dict) or not isinstance(data.get("success"), bool):
            raise EngineReplyError(self.url, f"{path} reply lacks success: {_one_line(data)}")
        if not data["success"]:
            raise EngineError(self.url, f"{path} failed: {_one_line(data.get('message'))}")
        return str(data.get("message", ""))

    # ---- generation ------------------------------------------------------------------------
    async def generate_one(self, req: GenerateRequest | dict) -> Completion:
        """One request: a GenerateRequest or a dict with the same keys."""
        if isinstance(req, dict):
            req = _request_from_dict(self.url, req)
        body = {
            "input_ids": list(req.input_ids),
            "sampling_params": dict(req.sampling_params),
            "return_logprob": req.return_logprob,
            "logprob_start_len": -1,
        }
        if req.rid is not None:
            body["rid"] = req.rid
        data = await self._call_ok("POST", "/generate", body, self.timeout)
        return parse_completion(self.url, data, req.return_logprob)

    async def generate(self, requests: Sequence[GenerateRequest | dict]) -> list[Completion]:
        """One HTTP request per item, concurrently, so the engine batches them dynamically."""
        return list(await asyncio.gather(*(self.generate_one(r) for r in requests)))

    # ---- control ---------------------------------------------------------------------------
    async def pause(self, mode: str = "abort") -> None:
        await self._call_ok("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._call_ok("POST", "/continue_generation", {})

    async def flush_cache(self) -> bool:
        """True if flushed; False when the engine refuses (requests still running)."""
        status, data = await self._call("POST", "/flush_cache")
        if status not in (200, 400):
            raise EngineError(self.url, f"/flush_cache answered HTTP {status}: {_one_line(data)}")
        return status == 200

    async def health(self, timeout_s: float | None = None) -> bool:
        """True iff /health_generate answers 200 within `timeout_s` (default: the control
        timeout); never raises for a down, hung or unhealthy engine."""
        try:
            status, _ = await self._call("GET", "/health_generate", timeout_s=timeout_s)
        except EngineError:
            return False
        return status == 200

    async def get_weight_version(self) -> str:
        data = await self._call_ok("GET", "/get_weight_version")
        if not isinstance(data, dict) or "weight_version" not in data:
            raise EngineReplyError(self.url, f"/get_weight_version reply: {_one_line(data)}")
        return str(data["weight_version"])

    async def update_weight_version(self, version: int | str) -> str:
        body = {"new_version": str(version), "abort_all_requests": False}
        return await self._call_success("/update_weight_version", body, None)

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
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._call_success("/init_weights_update_group", body, timeout_s)

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
        return await self._call_success("/update_weights_from_distributed", body, timeout_s)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> str:
        body = {"group_name": group_name}
        return await self._call_success("/destroy_weights_update_group", body, None)


def _request_from_dict(url: str, d: dict) -> GenerateRequest:
    unknown = set(d) - {"input_ids", "sampling_params", "rid", "return_logprob"}
    if unknown or "input_ids" not in d:
        raise ValueError(
            f"generate request for {url}: bad keys {sorted(unknown) or 'no input_ids'}"
        )
    return GenerateRequest(
        input_ids=list(d["input_ids"]),
        sampling_params=dict(d.get("sampling_params") or {}),
        rid=d.get("rid"),
        return_logprob=bool(d.get("return_logprob", True)),
    )


def _one_line(data: object, limit: int = 300) -> str:
    if isinstance(data, dict) and "message" in data:
        data = data["message"]
    text = " ".join(str(data).split())
    return text[:limit] + ("..." if len(text) > limit else "")

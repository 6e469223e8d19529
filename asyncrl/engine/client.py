"""EngineClient: SGLang's native HTTP protocol, one engine URL, async (aiohttp).

The same code drives a real SGLang server and asyncrl's hf server. Every call has a timeout;
every reply is checked before it is trusted: a malformed reply raises `EngineReplyError` naming
the engine URL and what is wrong, never a KeyError deep in the orchestrator.

Its control and weight-update calls are `EngineControl`'s (`engine/control.py`). Every
generate request carries a prefix-cache namespace (SGLang's `extra_key`) named after the newest
weight version this client knows the engine holds (from its replies, the sync it made, or the
version the dispatcher stamped on the prompt), so KV computed under old weights is never
matched by requests of a new one.

SGLang's native LoRA (`lora_sync: native`, `weights/lora_native.py`; a client made with
`lora=True`): each /generate names by `lora_path` the adapter `asyncrl-v{N}` of the newest
version N the engine reported (reported only once every engine holds it). A request runs
wholly on the adapter it named: its tokens get that version, whatever the engine reports at
the end. A refused adapter (unloaded meanwhile): ask the version again, retry once.

Through an sglang-router (a client made with `router=True`): the router's `/generate` takes
only SGLang's single form (sglang-router 0.3.2 types `sampling_params`, `return_logprob`, `rid`
and `extra_key` as single values and answers 422 to a list), so `generate` sends each request
as its own /generate, concurrently, as slime does: the router spreads them over its workers
(cache_aware keeps a group's shared prompt on one worker's prefix cache), and each worker's
scheduler batches them again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from asyncrl.engine.coalesce import Coalescer
from asyncrl.engine.control import EngineControl
from asyncrl.engine.http import EngineHTTP
from asyncrl.engine.replies import (
    FINISH_TYPES,
    Completion,
    EngineError,
    EngineReplyError,
    EngineTimeoutError,
    GenerateRequest,
    as_request,
    batch_items,
    generate_body,
    parse_completion,
    refused_request,
)
from asyncrl.engine.versions import PIN_KEY, EngineProfile
from asyncrl.weights.lora_names import adapter_name

__all__ = ["FINISH_TYPES", "Completion", "EngineClient", "EngineError", "EngineReplyError"]
__all__ += ["EngineTimeoutError", "GenerateRequest", "cache_namespace", "parse_completion"]
Out = TypeVar("Out")


def cache_namespace(version: int | None) -> str:
    """The `extra_key` of requests started under weight `version` (None: not known yet)."""
    return f"asyncrl-w{0 if version is None else version}"


class EngineClient(EngineControl):
    """One engine server. `timeout` (s) bounds generate calls, `control_timeout` the rest.

    `api_key`: the engine's shared secret (SGLang's `--api-key`), sent on every call as
    `Authorization: Bearer <api_key>`; None sends no header (an engine without a key).
    `lora`: generate on asyncrl's LoRA adapters (`lora_sync: native`, see above).
    `router`: `url` is an sglang-router: `generate` sends one single-form request per sample
    (see above); the fleet says so (`EngineFleet.routed`), never guessed from a reply."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 600.0,
        control_timeout: float = 60.0,
        max_connections: int = 256,
        api_key: str | None = None,
        lora: bool = False,
        router: bool = False,
    ) -> None:
        self.url = url.rstrip("/")
        self.router = router
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = EngineHTTP(self.url, headers, control_timeout, max_connections)
        self.seen_version: int | None = None  # newest weight version in this engine's replies
        self._profile: EngineProfile | None = None
        self._lora: int | None = None  # the adapter version requests name; None: no LoRA
        self._lora_known = not lora  # whether the engine was asked for its adapters yet
        # `generate` calls of one event-loop turn (a worker's groups) with the same keys and
        # extra_key share one /generate (never through a router: it takes no batch)
        self._batches: Coalescer[GenerateRequest, tuple[object, int | None]] = Coalescer(
            self._post_generate, refused_request
        )

    def __repr__(self) -> str:
        return f"EngineClient({self.url!r})"

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.http.close()

    # ---- generation ------------------------------------------------------------------------
    async def generate_one(
        self, req: GenerateRequest | dict, *, priority: int | None = None, pin: int | None = None
    ) -> Completion:
        """One request: a GenerateRequest or a dict with the same keys. `priority`: SGLang's
        scheduling priority (larger first; honoured by SGLang only with
        `--enable-priority-scheduling`, always by the hf server); None sends none. `pin`: as
        `generate`'s."""
        return await self._one(as_request(self.url, req), _keys(priority, pin))

    async def _one(self, request: GenerateRequest, keys: dict[str, Any]) -> Completion:
        (item,), lora = await self._post([request], False, keys)
        return self._completion(item, request, lora)

    async def generate(
        self,
        requests: Sequence[GenerateRequest | dict],
        *,
        priority: int | None = None,
        pin: int | None = None,
    ) -> list[Completion]:
        """The requests as ONE batched /generate (SGLang's list form of `input_ids`, with
        per-item `sampling_params`, `return_logprob` and `rid`, and one `extra_key`): one HTTP
        round trip and one parse for a whole group instead of one per sample, shared with the
        other `generate` calls of this event-loop turn with the same keys (`coalesce.py`: a
        worker's groups). Requests with different `extra_key`s go in one body per key. The
        engine schedules every item as its own request; the replies come back in order, each
        checked alone. Through a router (`router`): one single-form /generate per request,
        concurrently. `pin`: only weight version `pin` may serve them (engines whose profile
        has `pinned_versions`; see `versions.PIN_KEY`)."""
        reqs = [as_request(self.url, r) for r in requests]
        keys = _keys(priority, pin)
        if self.router:
            return await _all(self._one(r, keys) for r in reqs)
        by_key: dict[str | None, list[int]] = {}  # extra_key -> the indices of its requests
        for i, r in enumerate(reqs):
            by_key.setdefault(r.extra_key, []).append(i)
        turn = (id(asyncio.get_running_loop()), tuple(sorted(keys.items())))
        parts = await _all(  # merged with this turn's others of the same keys and extra_key
            self._batches.submit((*turn, extra), [reqs[i] for i in idx])
            for extra, idx in by_key.items()
        )
        replies: list[Any] = [None] * len(reqs)
        for idx, part in zip(by_key.values(), parts):
            for i, reply in zip(idx, part):
                replies[i] = reply
        return [self._completion(d, r, lora) for (d, lora), r in zip(replies, reqs)]

    async def _post_generate(self, key: Any, reqs: list[GenerateRequest]) -> list[tuple]:
        """`generate`'s one batched POST (see `coalesce.py`): per request, its raw reply item
        and the adapter version that served it."""
        items, lora = await self._post(reqs, True, dict(key[1]))
        return [(item, lora) for item in items]

    async def _post(
        self, reqs: list[GenerateRequest], batched: bool, keys: dict[str, Any]
    ) -> tuple[list[object], int | None]:
        """POST /generate (`generate_body`) with every body key the requests need: the cache
        namespace of those without an `extra_key` of their own, the priority, the adapter; a
        refused adapter is retried once on the engine's new one. The reply items, unchecked,
        and the adapter version they ran on."""
        lora, t = await self._current_lora(), self.timeout  # generation: not control_timeout
        try:
            data = await self.http.call_ok(
                "POST", "/generate", self._body(reqs, batched, keys, lora), t
            )
        except EngineError as e:
            if lora is None or "lora" not in e.problem.lower():
                raise
            await self.refresh_lora()
            if self._lora in (None, lora):
                raise
            lora = self._lora
            data = await self.http.call_ok(
                "POST", "/generate", self._body(reqs, batched, keys, lora), t
            )
        return (batch_items(self.url, data, len(reqs)) if batched else [data]), lora

    def _body(
        self, reqs: list[GenerateRequest], batched: bool, keys: dict[str, Any], lora: int | None
    ) -> dict:
        """`generate_body` of `reqs` in this client's cache namespace (its adapter's version
        with LoRA, else the newest weight version it knows the engine holds)."""
        namespace = cache_namespace(self.seen_version if lora is None else lora)
        lora_path = None if lora is None else adapter_name(lora)
        return generate_body(reqs, batched, namespace, lora_path, keys)

    def _completion(self, data: object, req: GenerateRequest, lora: int | None) -> Completion:
        completion = parse_completion(self.url, data, req.return_logprob, req.return_routed_experts)
        self.saw_version(completion.version)
        if lora is not None:  # every token was sampled by the adapter the request named
            completion = replace(completion, weight_version=str(lora), output_token_versions=None)
        return completion

    # ---- the adapter requests name ----------------------------------------------------------
    async def refresh_lora(self) -> None:
        """Name the adapter of the version the engine reports, asked by a 1-token /generate
        (routed like any request; every engine holds the adapter of a reported version)."""
        body = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1}, "return_logprob": False}
        data = await self.http.call_ok("POST", "/generate", body, self.timeout)
        version = parse_completion(self.url, data, False).version
        if version is None:
            raise EngineReplyError(self.url, "its weight_version names no adapter of asyncrl's")
        self.seen_version = self._lora = max(self.seen_version or 0, version)
        self._lora_known = True

    async def _current_lora(self) -> int | None:
        """The adapter version the next request names (None: no adapter of asyncrl's)."""
        if not self._lora_known:
            await self.refresh_lora()
        if self._lora is not None and (self.seen_version or 0) > self._lora:
            self._lora = self.seen_version
        return self._lora


def _keys(priority: int | None, pin: int | None) -> dict[str, Any]:
    """/generate keys beyond the requests' own: SGLang's `priority`, the hf server's pin."""
    keys: dict[str, Any] = {} if priority is None else {"priority": priority}
    return keys if pin is None else {**keys, PIN_KEY: str(pin)}


async def _all(calls: Iterable[Awaitable[Out]]) -> list[Out]:
    """Every call's result, in order; the first failure cancels the others (their connections
    closed: the engine aborts those requests) and is raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise

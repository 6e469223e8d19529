"""What engines are asked and answer: `/generate` bodies (single or SGLang's batch form), the
errors, and `/generate` replies checked into `Completion`s.

Every reply is checked before it is trusted: a malformed one raises `EngineReplyError` naming
the engine URL and what is wrong. Per-token weight versions come from SGLang's spans
(`meta_info["weight_versions"]`, 0.5.23) or asyncrl's hf server's per-token list; otherwise
every token gets the request's final `weight_version`. Routed experts (mixture-of-experts
policies, `return_routed_experts`): SGLang's `meta_info["routed_experts"]`, base64 of int32
[prompt + output - 1, layers, top_k], become a uint8 [positions, layers * top_k] array
(`parse_routes`), every id checked.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FINISH_TYPES = ("stop", "length", "abort")


class EngineError(RuntimeError):
    """An engine call failed (connection, HTTP status, or an explicit `success: false`)."""

    def __init__(self, url: str, problem: str, status: int | None = None) -> None:
        super().__init__(f"engine {url}: {problem}")
        self.url = url
        self.problem = problem
        self.status = status
        """The HTTP status the engine answered with, where that is the failure."""


_HTTP_STATUS = re.compile(r"answered HTTP (\d{3})")


def http_status(error: EngineError) -> int | None:
    """The HTTP status an engine answered with, if the error is one (else None): its `status`,
    or the one its message names."""
    if error.status is not None:
        return error.status
    match = _HTTP_STATUS.search(str(error))
    return int(match.group(1)) if match else None


def refused_request(error: BaseException) -> bool:
    """Whether the engine refused the request itself (HTTP 4xx): another body may pass."""
    status = http_status(error) if isinstance(error, EngineError) else None
    return status is not None and 400 <= status < 500


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
    extra_key: str | None = None
    """SGLang's prefix-cache namespace; None: the client's own, from the weight version
    (`cache_namespace`)."""
    return_routed_experts: bool = False
    """Ask for each position's routed experts (SGLang's field; a mixture-of-experts policy)."""


@dataclass(frozen=True)
class Completion:
    output_ids: list[int]
    output_logprobs: list[float]  # empty when return_logprob was False
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str  # as the engine reports it (SGLang versions are strings)
    prompt_tokens: int
    rid: str = ""
    output_token_versions: list[str] | None = None  # hf server, or SGLang's version spans
    abort_status: int | None = None  # an abort's HTTP-like status (SGLang: 400 = bad input)
    abort_message: str = ""
    routed_experts: np.ndarray | None = None  # uint8 [positions, layers * top_k] (asked for)

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

        asyncrl's hf server reports the version that sampled each token, SGLang 0.5.23 spans of
        them (`meta_info["weight_versions"]`). Older SGLang reports one version per request
        (the one current when it finished), so every token gets it; tokens sampled before an
        in-place/retract weight update are then labelled with the newer version (their
        logprobs are still the sampling policy's own).
        """
        if self.output_token_versions is not None:
            return [_as_version(v) for v in self.output_token_versions]
        if self.version is None:
            raise ValueError(f"weight_version {self.weight_version!r} is not an integer version")
        return [self.version] * len(self.output_ids)


def parse_completion(
    url: str, obj: object, want_logprob: bool, want_routes: bool = False
) -> Completion:
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
    if versions is None and meta.get("weight_versions") is not None:
        versions = _spans_to_tokens(meta["weight_versions"], len(out), bad)
    if versions is not None and (not isinstance(versions, list) or len(versions) != len(out)):
        raise bad("output_token_weight_versions is not one version per output token")
    if versions is not None and not all(_is_version(v) for v in versions):
        raise bad("output_token_weight_versions holds a non-integer version")
    routes = None
    if want_routes:
        rows = prompt_tokens + len(out) - 1 if out else 0
        routes = parse_routes(meta.get(ROUTES_REPLY_KEY), rows, bad)
    return Completion(
        routed_experts=routes,
        output_ids=out,
        output_logprobs=logprobs,
        finish_reason=finish["type"],
        weight_version=str(meta["weight_version"]),
        prompt_tokens=prompt_tokens,
        rid=str(meta.get("id", "")),
        output_token_versions=[str(v) for v in versions] if versions is not None else None,
        abort_status=finish.get("status_code") if _is_int(finish.get("status_code")) else None,
        abort_message=str(finish.get("message") or "") if finish["type"] == "abort" else "",
    )


#: The reply's meta_info key of the routed experts (SGLang's).
ROUTES_REPLY_KEY = "routed_experts"
#: Expert ids travel as uint8; 255 marks a position without routes (`types.UNROUTED`).
MAX_EXPERT_ID = 254


def parse_routes(value: object, rows: int, bad) -> np.ndarray:
    """`meta_info["routed_experts"]` (base64 of int32 [rows, layers, top_k]) as uint8
    [rows, layers * top_k]; `rows`: the positions it must cover (prompt + output - 1). With
    no output token (`rows` 0: an abort before or at its prefill) nothing is kept: the
    continuation's reply covers those positions."""
    if not isinstance(value, str):
        raise bad(f"return_routed_experts was set but {ROUTES_REPLY_KEY} is not a base64 string")
    if rows == 0:
        return np.zeros((0, 1), np.uint8)
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"{ROUTES_REPLY_KEY} is not valid base64") from None
    if len(raw) % 4:
        raise bad(f"{ROUTES_REPLY_KEY} holds {len(raw)} bytes, not int32 values")
    ids = np.frombuffer(raw, dtype="<i4")
    if ids.size == 0 or ids.size % rows:
        raise bad(f"{ROUTES_REPLY_KEY} holds {ids.size} ids, not a multiple of {rows} positions")
    if int(ids.min()) < 0 or int(ids.max()) > MAX_EXPERT_ID:
        raise bad(f"{ROUTES_REPLY_KEY} holds an expert id outside [0, {MAX_EXPERT_ID}]")
    return ids.astype(np.uint8).reshape(rows, ids.size // rows)


def _spans_to_tokens(spans: object, n: int, bad) -> list[str]:
    """SGLang's `[{"version", "start", "end"}, ...]` (contiguous, covering every output token)
    -> one version per token."""
    if not isinstance(spans, list) or not spans:
        raise bad("weight_versions is not a non-empty list of spans")
    out: list[str] = []
    for span in spans:
        if not isinstance(span, dict) or not all(_is_int(span.get(k)) for k in ("start", "end")):
            raise bad(f"weight_versions span {span!r} is not {{version, start, end}}")
        if span["start"] != len(out) or span["end"] < span["start"]:
            raise bad(f"weight_versions span {span!r} does not continue at token {len(out)}")
        out += [str(span.get("version"))] * (span["end"] - span["start"])
    if len(out) != n:
        raise bad(f"weight_versions spans cover {len(out)} tokens, the output has {n}")
    return out


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


def as_request(url: str, d: GenerateRequest | dict) -> GenerateRequest:
    """A generate request: a GenerateRequest as it is, or one made of a dict of its keys."""
    if isinstance(d, GenerateRequest):
        return d
    known = {"input_ids", "sampling_params", "rid", "return_logprob", "extra_key"}
    unknown = set(d) - known - {"return_routed_experts"}
    if unknown or "input_ids" not in d:
        raise ValueError(
            f"generate request for {url}: bad keys {sorted(unknown) or 'no input_ids'}"
        )
    return GenerateRequest(
        input_ids=list(d["input_ids"]),
        sampling_params=dict(d.get("sampling_params") or {}),
        rid=d.get("rid"),
        return_logprob=bool(d.get("return_logprob", True)),
        extra_key=d.get("extra_key"),
        return_routed_experts=bool(d.get("return_routed_experts", False)),
    )


def one_line(data: object, limit: int = 300) -> str:
    """An engine's reply (its `message` where it has one) as one line of at most `limit`."""
    if isinstance(data, dict) and "message" in data:
        data = data["message"]
    text = " ".join(str(data).split())
    return text[:limit] + ("..." if len(text) > limit else "")


def batch_items(url: str, data: object, n: int) -> list:
    """The items of a batched /generate reply: a list of exactly `n` (one per request)."""
    if not isinstance(data, list) or len(data) != n:
        got = f"{len(data)} items" if isinstance(data, list) else type(data).__name__
        raise EngineReplyError(url, f"malformed /generate reply: {got} for a batch of {n}")
    return data


def generate_body(
    reqs: Sequence[GenerateRequest],
    batched: bool,
    namespace: str,
    lora_path: str | None = None,
    keys: Mapping[str, Any] | None = None,
) -> dict:
    """The exact /generate body `EngineClient` sends for `reqs`: SGLang's list form (a value
    per item) when `batched`, else the single form of the one request. SGLang wants one `rid`
    per item, or none.

    `namespace`: the prefix-cache namespace (`extra_key`) of requests without one of their own.
    A body carries ONE `extra_key` string, batched too: SGLang before 0.5.14 hands each item of
    a batch the whole `extra_key` list (`GenerateReqInput.__getitem__`), which its radix cache
    cannot hash; so the requests of a batched body must share one (the client splits a batch
    by it). `lora_path`: the adapter every item runs on (None: the base model); `keys`: the
    body's further keys (SGLang's `priority`, the hf server's pin)."""
    if not reqs or (not batched and len(reqs) != 1):
        raise ValueError(f"a {'batched' if batched else 'single'} /generate of {len(reqs)}")
    extra_keys = {r.extra_key or namespace for r in reqs}
    if len(extra_keys) > 1:
        raise ValueError(f"one /generate body with several extra_keys: {sorted(extra_keys)}")

    def each(value: Callable[[GenerateRequest], object]) -> object:
        return [value(r) for r in reqs] if batched else value(reqs[0])

    body = {
        "input_ids": each(lambda r: list(r.input_ids)),
        "sampling_params": each(lambda r: dict(r.sampling_params)),
        "return_logprob": each(lambda r: r.return_logprob),
        "logprob_start_len": -1,
    }
    if any(r.return_routed_experts for r in reqs):  # only then: SGLang before 0.5.10 lacks it
        # ONE bool per body, batched too: SGLang hands each item the body's value as it is
        # (a list would reach every item whole); an item that did not ask ignores its routes
        body["return_routed_experts"] = True
    if any(r.rid is not None for r in reqs):
        body["rid"] = each(lambda r: r.rid or uuid.uuid4().hex)
    body |= dict(keys or {})
    body["extra_key"] = extra_keys.pop()
    if lora_path is not None:
        body["lora_path"] = lora_path
    return body

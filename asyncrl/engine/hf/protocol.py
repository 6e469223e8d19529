"""The hf server's request bodies: JSON in, checked values out, one clear line per problem.

Every field is checked for its JSON type and range before the engine sees it; a problem raises
`RequestError` (HTTP 400) naming the field, with the offending value shown short (`show`), so a
hostile body (huge, deeply nested, NaN, wrong types, unknown keys) gets a one-line 400 and never
a 500 or a stuck engine. Shapes follow SGLang's request structs (`io_struct.py`).
"""

from __future__ import annotations

import json
import math
import uuid

from aiohttp import web

from asyncrl.engine.hf.batch import RequestError, SamplingParams, Seq, is_neutral, show
from asyncrl.engine.hf.routes import REQUEST_KEY as ROUTES_KEY
from asyncrl.engine.versions import PIN_KEY
from asyncrl.weights.group import BACKENDS

_MISSING = object()
# /generate keys SGLang defines that this server does not implement: accepted only at the value
# that changes nothing, so a caller never silently gets something else.
_GENERATE_NEUTRAL = {
    "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None,),
    "return_text_in_logprobs": (None, False, True),  # there is no text either way
    "image_data": (None,),
    "lora_path": (None,),
    "custom_logit_processor": (None,),
    "return_hidden_states": (None, False),
    # what sglang-router (0.3.2) adds to every body it forwards, at these values
    "model": (None,),
    "log_metrics": (None, True, False),  # server-side logging only
    "no_logs": (None, False, True),
    "background": (None, False),
    "return_bytes": (None, False),
    "return_entropy": (None, False),
}
_GENERATE_KEYS = {"input_ids", "text", "sampling_params", "rid", "return_logprob"}
_GENERATE_KEYS |= {"logprob_start_len", "stream", "extra_key", "priority", PIN_KEY}
_GENERATE_KEYS |= {ROUTES_KEY}  # SGLang's `return_routed_experts` (routes.py)
#: `extra_key` is SGLang's prefix-cache namespace. This server keeps no prefix cache (every
#: request prefills its own KV, dropped when it finishes), so no KV is ever shared across
#: requests, let alone across weight versions: the field is checked (a string, or a list of
#: them for a batch) and has nothing else to do.
MAX_EXTRA_KEY_CHARS = 256
#: `priority` as SGLang takes it (`GenerateReqInput.priority`): a signed 64-bit int, null = the
#: default (0 here, as `--default-priority-value 0`). A larger value is admitted first, as
#: SGLang's `--enable-priority-scheduling` without `--schedule-low-priority-values-first`; this
#: server always schedules by it (all requests at 0: plain FIFO). See `engine.py` for the rule.
PRIORITY_RANGE = (-(1 << 63), (1 << 63) - 1)
MAX_VERSION_CHARS = 64
MAX_GROUP_TIMEOUT_S = 86400.0


def read_json(raw: bytes, required: bool = True) -> dict:
    """The body as a JSON object ({} when empty and not `required`)."""
    if not raw.strip():
        if required:
            raise RequestError("request body must be a JSON object")
        return {}
    try:
        body = json.loads(raw)
    except RecursionError:  # the C parser recurses once per nesting level
        raise RequestError("request body is nested too deeply") from None
    except ValueError as e:
        raise RequestError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def field(body: dict, key: str, types: type | tuple[type, ...], default: object = _MISSING):
    """`body[key]` if it has one of `types` (a bool never passes as an int); `default` when
    absent or null; RequestError naming the key otherwise (or when required and absent)."""
    value = body.get(key)
    if value is None:
        if default is _MISSING:
            raise RequestError(f"field {key!r} is required")
        return default
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        raise RequestError(f"field {key!r} must be {names}, got {show(value)}")
    return value


def version(body: dict, key: str, required: bool) -> str | None:
    """A weight version: "default" or an integer (as an int or a decimal string). SGLang takes
    any string, but asyncrl's clients read versions as integers (`Completion.version`): any
    other would make every later reply unreadable to them."""
    value = field(body, key, (str, int), _MISSING if required else None)
    if value is None:
        return None
    text = str(value)
    if text != "default" and not (
        len(text) <= MAX_VERSION_CHARS and text.removeprefix("-").isdecimal() and text.isascii()
    ):
        raise RequestError(f"field {key!r} must be 'default' or an integer, got {show(value)}")
    return text


def _is_ids(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _per_item(body: dict, key: str, n: int, batched: bool, check) -> list:
    """SGLang batch bodies may give one value for all items or a list with one per item."""
    value = body.get(key)
    if batched and isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{key} has {len(value)} entries for a batch of {n}")
        return [check(v) for v in value]
    return [check(value)] * n


def _typed(key: str, types: tuple[type, ...]):
    def check(v: object) -> object:
        if v is not None and (
            isinstance(v, bool) and bool not in types or not isinstance(v, types)
        ):
            raise RequestError(
                f"{key} must be {' or '.join(t.__name__ for t in types)}, got {show(v)}"
            )
        return v

    return check


def _check_generate_keys(body: dict) -> None:
    for key, value in body.items():
        if key in _GENERATE_NEUTRAL:
            if not is_neutral(value, _GENERATE_NEUTRAL[key]):
                raise RequestError(f"{key}={show(value)} is not supported by the hf server")
        elif key not in _GENERATE_KEYS:
            raise RequestError(f"unknown /generate field {show(key)}")
    if body.get("text") is not None:
        raise RequestError("this server has no tokenizer: send input_ids, not text")
    if body.get("stream") not in (None, False):
        raise RequestError("stream=true is not supported by the hf server")
    start = body.get("logprob_start_len", -1)
    if start not in (-1, None) or isinstance(start, bool):
        raise RequestError("logprob_start_len >= 0 (input logprobs) is not supported here")


def parse_generate(body: dict, on_done) -> tuple[list[Seq], bool]:
    """The requests of a /generate body (one, or a batch) and whether it was a batch."""
    _check_generate_keys(body)
    ids = body.get("input_ids")
    batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    if ids is None or not prompts or not all(_is_ids(p) and p for p in prompts):
        raise RequestError("input_ids must be a non-empty list of ints (or a list of such lists)")
    n = len(prompts)
    params = _per_item(body, "sampling_params", n, batched, SamplingParams.from_json)
    rids = _per_item(body, "rid", n, batched, _typed("rid", (str,)))
    for key in _per_item(body, "extra_key", n, batched, _typed("extra_key", (str,))):
        if key is not None and len(key) > MAX_EXTRA_KEY_CHARS:
            raise RequestError(f"extra_key is longer than {MAX_EXTRA_KEY_CHARS} characters")
    logprob = _per_item(body, "return_logprob", n, batched, _typed("return_logprob", (bool,)))
    priority = _per_item(body, "priority", n, batched, _priority)
    pins = _per_item(body, PIN_KEY, n, batched, lambda v: version({PIN_KEY: v}, PIN_KEY, False))
    want_routes = _per_item(body, ROUTES_KEY, n, batched, _typed(ROUTES_KEY, (bool,)))
    return [
        Seq(
            rids[i] or uuid.uuid4().hex,
            list(prompts[i]),
            params[i],
            on_done,
            bool(logprob[i]),
            priority=priority[i],
            pin=pins[i],
            return_routes=bool(want_routes[i]),
        )
        for i in range(n)
    ], batched


def _priority(value: object) -> int:
    """A request's priority: an int in SGLang's signed 64-bit range; null is 0."""
    value = _typed("priority", (int,))(value)
    if value is None:
        return 0
    lo, hi = PRIORITY_RANGE
    if not lo <= value <= hi:
        raise RequestError(f"priority must be a signed 64-bit integer, got {show(value)}")
    return value


def group_init(body: dict, default_timeout_s: float) -> tuple:
    """`/init_weights_update_group` arguments, checked: this engine joins as a non-zero rank
    (rank 0, the learner, hosts the rendezvous; an engine never binds it)."""
    addr = field(body, "master_address", str)
    port = field(body, "master_port", int)
    offset, world = field(body, "rank_offset", int), field(body, "world_size", int)
    if not 1 <= port <= 65535:
        raise RequestError(f"field 'master_port' must be in [1, 65535], got {port}")
    if not 1 <= offset < world <= 1 << 20:
        raise RequestError(f"need 1 <= rank_offset < world_size, got {offset} and {world}")
    name = field(body, "group_name", str, "weight_update_group")
    if not name or len(name) > 256:
        raise RequestError("field 'group_name' must be 1 to 256 characters")
    backend = field(body, "backend", str, "nccl")
    if backend not in BACKENDS:
        raise RequestError(f"field 'backend' must be one of {', '.join(BACKENDS)}")
    timeout = field(body, "timeout", (int, float), default_timeout_s)
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_GROUP_TIMEOUT_S):
        raise RequestError(f"field 'timeout' must be in (0, {MAX_GROUP_TIMEOUT_S:g}] seconds")
    return addr, port, offset, world, name, backend, float(timeout)


def ok_reply(success: bool, message: str, **extra) -> web.Response:
    """SGLang's reply to a control call: `success` and a message (HTTP 400 when it failed)."""
    body = {"success": success, "message": message, **extra}
    return web.json_response(body, status=200 if success else 400)

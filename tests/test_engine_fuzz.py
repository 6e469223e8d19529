"""Fuzz the hf engine server's HTTP API: no body gets anything but a 200 or a one-line 4xx, and
the engine still generates afterwards.

Bodies mix well-formed requests with hostile ones: huge, negative, NaN and infinite numbers,
wrong types, deep nesting, unknown keys, raw bytes that are not JSON. A 200 from /generate must
be a well-formed SGLang reply (the client's own checker reads it: finite logprobs, one per
token). The server is real (a tiny random Qwen2 with a 64-token context, so any length the
fuzzer asks for ends fast); only the requests are generated.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.engine.client import parse_completion
from asyncrl.engine.hf.launch import launch_hf_server

VOCAB, CONTEXT = 64, 64
HOSTILE_NUMBERS = [0, -1, 1, 2, 1e-300, 1e-45, 1e-7, 0.5, 1.0, 1.5, 1e300, 2**31, 2**63, 2**64]
HOSTILE_NUMBERS += [-(2**63) - 1, 10**30, -(10**30), float("nan"), float("inf"), float("-inf")]
CORE_KEYS = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop_token_ids"]
CORE_KEYS += ["ignore_eos", "sampling_seed"]
EXTRA_KEYS = ["n", "stop", "repetition_penalty", "regex", "skip_special_tokens", "min_new_tokens"]
EXTRA_KEYS += ["logit_bias", "no_such_param"]
GENERATE_KEYS = ["sampling_params", "rid", "return_logprob", "logprob_start_len", "stream"]
GENERATE_KEYS += ["text", "top_logprobs_num", "no_such_field"]
CONTROL = {
    "/pause_generation": ["mode"],
    "/abort_request": ["rid", "abort_all"],
    "/update_weight_version": ["new_version", "abort_all_requests"],
    "/update_weights_from_distributed": ["names", "dtypes", "shapes", "group_name", "load_format"],
    "/destroy_weights_update_group": ["group_name"],
    "/flush_cache": [],
    "/continue_generation": [],
    "/get_load": [],
    "/get_weight_version": [],
}

numbers = st.one_of(
    st.sampled_from(HOSTILE_NUMBERS),
    st.integers(min_value=-3, max_value=VOCAB + 3),
    st.integers(),
    st.floats(),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=12))
any_json = st.recursive(
    scalars,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=6), kids, max_size=4)
    ),
    max_leaves=10,
)
prompt = st.lists(st.integers(min_value=0, max_value=VOCAB - 1), min_size=1, max_size=8)
token_lists = st.lists(st.integers(min_value=-2, max_value=VOCAB + 2), min_size=0, max_size=70)
value = (
    st.one_of(
        numbers, numbers, numbers, st.booleans(), st.lists(st.integers(-1, VOCAB + 1), max_size=3)
    )
    | any_json
)
sampling = st.dictionaries(st.sampled_from(CORE_KEYS), value, max_size=5) | st.dictionaries(
    st.sampled_from(CORE_KEYS + EXTRA_KEYS), value, max_size=4
)
# Well-formed around the sampling parameters (most bodies: they reach the engine) ...
plausible_generate = st.fixed_dictionaries(
    {"input_ids": prompt | st.lists(prompt, min_size=1, max_size=3) | token_lists},
    optional={
        "sampling_params": sampling | st.lists(sampling, max_size=3),
        "return_logprob": st.booleans() | any_json,
        "rid": st.text(max_size=8) | any_json,
    },
)
# ... and hostile anywhere.
hostile_generate = st.fixed_dictionaries(
    {"input_ids": prompt | token_lists | any_json},
    optional={
        k: (sampling | st.lists(sampling, max_size=3)) if k == "sampling_params" else any_json
        for k in GENERATE_KEYS
    },
)
generate_body = st.one_of(plausible_generate, plausible_generate, plausible_generate)
generate_body |= hostile_generate


@st.composite
def control_call(draw):
    path = draw(st.sampled_from(sorted(CONTROL)))
    keys = CONTROL[path]
    body = draw(st.dictionaries(st.sampled_from(keys), any_json) if keys else st.just({}))
    return path, json.dumps(body).encode()


def deep(n: int) -> bytes:
    return b'{"input_ids": [1], "rid": ' + b"[" * n + b"]" * n + b"}"


raw_bodies = st.sampled_from(
    [b"", b"{", b"null", b"[1, 2]", b'"x"', b"\xff\xfe", b"[" * 50_000, deep(2000), deep(300)]
    + [b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}']
    + [b'{"input_ids": [1], "sampling_params": {"top_p": -Infinity}}']
)
generate_call = generate_body.map(lambda b: ("/generate", json.dumps(b).encode()))
calls = st.one_of(
    generate_call,
    generate_call,
    control_call(),
    raw_bodies.map(lambda raw: ("/generate", raw)),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("fuzz-model")
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=CONTEXT,
        eos_token_id=1, tie_word_embeddings=False,
    )  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    args = ["--num-threads", "1", "--group-timeout-s", "2"]
    handle = launch_hf_server(path, max_batch_size=4, extra_args=args)
    yield handle
    handle.stop()


def post(url: str, path: str, raw: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(url + path, data=raw, method="POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def check_reply(url: str, path: str, request: bytes, status: int, raw: bytes) -> None:
    what = f"{path} {request[:200]!r} -> {status} {raw[:300]!r}"
    assert status == 200 or 400 <= status < 500, what
    if status != 200:
        try:
            message = json.loads(raw)["message"]
        except (ValueError, KeyError, TypeError):
            message = raw.decode()  # SGLang answers a refused /flush_cache in plain text
        assert message.strip() and "\n" not in message.strip(), what
        return
    if path == "/generate":
        body = json.loads(request)
        data = json.loads(raw)
        items = data if isinstance(data, list) else [data]
        want = body.get("return_logprob")
        for i, item in enumerate(items):
            flag = want[i] if isinstance(want, list) else want
            out = parse_completion(url, item, bool(flag))  # raises on a malformed reply
            assert all(math.isfinite(lp) for lp in out.output_logprobs), what


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health_generate", timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(call=calls)
def test_any_body_gets_a_200_or_a_one_line_4xx(server, call):
    path, raw = call
    try:
        status, reply = post(server.url, path, raw)
        check_reply(server.url, path, raw, status, reply)
    finally:
        post(server.url, "/continue_generation", b"{}")  # a pause must not starve what follows
    assert health(server.url) == 200, f"engine unhealthy after {path} {raw[:200]!r}"


def test_the_engine_still_generates_after_the_fuzz(server):
    body = {
        "input_ids": [3, 4, 5],
        "sampling_params": {"max_new_tokens": 4},
        "return_logprob": True,
    }
    status, raw = post(server.url, "/generate", json.dumps(body).encode())
    assert status == 200
    assert len(parse_completion(server.url, json.loads(raw), True).output_logprobs) >= 1

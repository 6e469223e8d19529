"""The weight sync per SGLang release, through the version-faithful fake (tests/fake_sglang,
`upstream.py`): the real EngineClient + WeightSender, a request in flight during every sync.

Each test fails on the protocol asyncrl used before it followed the reported version: a flush
on the last bucket (0.5.6 dies, 0.5.23 refuses), no weight-update session (0.5.23 refuses the
buckets), the version lost while paused (0.5.6), an aborted sample trained as finished.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from asyncrl.engine import sglang as sl
from asyncrl.engine import sglang_process as sp
from asyncrl.engine.client import EngineClient
from asyncrl.engine.versions import UnsupportedEngineError, parse_version, profile_for
from asyncrl.net import free_port
from asyncrl.rollout.settings import PermanentRolloutError
from asyncrl.rollout.single_turn import generate_continued
from asyncrl.weights.sync import WeightSender

FAKE = str(Path(__file__).parent / "fake_sglang")
TOKENS = 30  # per request; at DELAY s per token the request is in flight for ~1.5 s
DELAY = 0.05


def start_fake(
    tmp_path: Path, version: str, delay: float = DELAY, flags: dict | None = None, lora=None
):
    """A fake SGLang `version` launched as asyncrl launches SGLang: `delay` s per token, server
    `flags` (strategy_config keys), LoRA serving `lora` (`sl.LoraServing`)."""
    env = {
        "PYTHONPATH": os.pathsep.join([FAKE, os.environ.get("PYTHONPATH", "")]),
        "FAKE_SGLANG_VERSION": version,
        "FAKE_SGLANG_TOKEN_DELAY_S": str(delay),
    }
    settings = sl.with_lora(sl.SGLangSettings.parse({"env": env, **(flags or {})}), lora)
    port = free_port()
    cmd = sl.server_command(tmp_path, port, 1, settings)
    url = f"http://127.0.0.1:{port}"
    handle = sp.start_process(cmd, settings.env, url, tmp_path / f"fake_{port}.log")
    return sp.wait_healthy(handle, "/health_generate", 90, f"fake sglang {version}")


def state(url: str) -> dict:
    with urllib.request.urlopen(url + "/_fake/state", timeout=10) as r:
        return json.loads(r.read())


async def until_in_flight(url: str, task: asyncio.Task) -> None:
    """Poll the fake (deadline, no fixed sleep) until a request runs; fail if it ended first."""
    deadline = time.monotonic() + 30
    while not (await asyncio.to_thread(state, url))["in_flight"]:
        assert not task.done(), f"the request ended before it was seen running: {task.result()}"
        assert time.monotonic() < deadline, "request never seen in flight"
        await asyncio.sleep(0.01)


async def sync_while_generating(url: str, pause_mode: str):
    """A request in flight, a sync to version 1 in `pause_mode` meanwhile; the request's
    (continued) completion."""
    async with EngineClient(url, timeout=60, control_timeout=30) as client:
        sender = WeightSender(group_name="versions", timeout_s=30)
        await sender.init_group([client], backend="gloo")
        request = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": TOKENS}}
        task = asyncio.create_task(generate_continued(client, request, TOKENS))
        await until_in_flight(url, task)
        await sender.sync([("w", torch.ones(4))], 1, load_format=None, pause_mode=pause_mode)
        completion = await asyncio.wait_for(task, 60)
        await sender.close()
        return completion


@pytest.mark.timing
@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_in_place_sync_during_generation_keeps_engine_alive_and_versioned(tmp_path, version):
    """in_place: no flush at all (the paused request keeps its KV: 0.5.6 would die on the
    refused flush, 0.5.23 fail the update), the session where required, the version set."""
    handle = start_fake(tmp_path, version)
    try:
        c = asyncio.run(sync_while_generating(handle.url, "in_place"))
        assert handle.proc.poll() is None, handle.log_tail()
        got = state(handle.url)
        assert got["violations"] == [] and got["version"] == "1"
        paths = [p for p, _ in got["calls"]]
        assert "/flush_cache" not in paths
        updates = [b for p, b in got["calls"] if p == "/update_weights_from_distributed"]
        assert updates and not any(b["flush_cache"] for b in updates)
        sync = paths[paths.index("/pause_generation") : paths.index("/continue_generation") + 1]
        if version == "0.5.23":  # buckets inside one session, closed before generation goes on
            assert sync == [
                "/pause_generation", "/begin_weight_update", "/update_weights_from_distributed",
                "/end_weight_update", "/continue_generation",
            ]  # fmt: skip
        else:  # 0.5.6 drops the bucket's version while paused: it is set explicitly
            assert sync == [
                "/pause_generation", "/update_weights_from_distributed",
                "/update_weight_version", "/continue_generation",
            ]  # fmt: skip
            assert got["calls"][paths.index("/update_weight_version")][1] == {
                "new_version": "1", "abort_all_requests": False,
            }  # fmt: skip
        assert c.finish_reason == "length" and len(c.output_ids) == TOKENS
        versions = c.token_versions()
        assert versions[-1] == 1 and c.version == 1
        if version == "0.5.23":  # per-token spans: tokens before the sync keep version 0
            assert versions[0] == 0 and sorted(versions) == versions
    finally:
        handle.stop()


@pytest.mark.timing
@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_abort_sync_flushes_once_idle_and_the_sample_is_continued(tmp_path, version):
    """abort: the running request comes back partial (finish abort); the sync polls the flush
    until accepted; the sample is continued to its full length, never kept as finished; the
    engine reports the new version (0.5.6 drops the bucket's own while paused)."""
    handle = start_fake(tmp_path, version)
    try:
        c = asyncio.run(sync_while_generating(handle.url, "abort"))
        got = state(handle.url)
        assert got["violations"] == [] and got["flushes"] >= 1 and got["version"] == "1"
        generates = [b for p, b in got["calls"] if p == "/generate"]
        assert len(generates) == 2  # the original and one continuation
        first, cont = generates
        assert cont["input_ids"][: len(first["input_ids"])] == first["input_ids"]
        done = len(cont["input_ids"]) - len(first["input_ids"])
        assert 0 < done < TOKENS and cont["sampling_params"]["max_new_tokens"] == TOKENS - done
        assert c.finish_reason == "length" and len(c.output_ids) == TOKENS
        assert len(c.output_logprobs) == TOKENS
        versions = c.token_versions()
        assert versions[:done] == [0] * done and versions[done:] == [1] * (TOKENS - done)
    finally:
        handle.stop()


@pytest.mark.timing
def test_retract_where_the_idle_check_counts_the_waiting_queue_does_not_wait_for_a_flush(
    tmp_path,
):
    """0.5.15 counts retracted (waiting) requests as busy: a flush can never succeed while
    paused, so none is asked for (the per-version cache namespace keeps old KV apart)."""
    handle = start_fake(tmp_path, "0.5.15")
    try:
        c = asyncio.run(sync_while_generating(handle.url, "retract"))
        got = state(handle.url)
        assert got["version"] == "1" and "/flush_cache" not in [p for p, _ in got["calls"]]
        assert c.finish_reason == "length" and len(c.output_ids) == TOKENS
    finally:
        handle.stop()


def test_every_generate_carries_the_cache_namespace_of_the_version_synced(tmp_path):
    """`extra_key` names the newest weight version the client knows the engine holds: the
    syncing client from its own sync, another client (a rollout worker's) from the version the
    dispatcher stamps on the prompt — never first from a reply, one request too late."""
    handle = start_fake(tmp_path, "0.5.23", delay=0.0)

    async def go():
        async with EngineClient(handle.url) as client, EngineClient(handle.url) as worker:
            sender = WeightSender(group_name="ns", timeout_s=30)
            await sender.init_group([client], backend="gloo")
            req = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
            await client.generate_one(req)
            await worker.generate_one(req)
            await sender.sync([("w", torch.ones(2))], 4, load_format=None, pause_mode="in_place")
            await client.generate_one(req)  # the syncing client: v4 from its own sync
            worker.saw_version(4)  # the stamp a prompt handed out after the sync carries
            await worker.generate_one(req)
            worker.saw_version(None)  # a prompt from before any sync: nothing known, no change
            worker.saw_version(2)  # an older stamp never lowers it
            await worker.generate_one(req)
            await sender.close()

    try:
        asyncio.run(go())
        got = state(handle.url)
        keys = [b["extra_key"] for p, b in got["calls"] if p == "/generate"]
        assert keys == ["asyncrl-w0", "asyncrl-w0", "asyncrl-w4", "asyncrl-w4", "asyncrl-w4"]
        # the prompt's KV cached under version 0 is never served after the sync (no flush:
        # in_place); under v4 it is cached anew and reused
        assert got["cached"] == [0, 2, 0, 2, 2] and got["flushes"] == 0
    finally:
        handle.stop()


def test_version_profiles_and_the_supported_range():
    assert parse_version("0.5.15.post1") == (0, 5, 15)
    old, new, mid = profile_for("0.5.6"), profile_for("0.5.23"), profile_for("0.5.15")
    assert not old.session and old.explicit_version and "retract" in old.flush_modes
    assert new.session and not new.explicit_version and "retract" in new.flush_modes
    assert mid.flush_modes == ("abort",)
    for bad in ("0.5.5", "0.5.24", "0.6.0", "nightly"):
        with pytest.raises(UnsupportedEngineError, match="0.5.6..0.5.23|MAJOR"):
            profile_for(bad)


def test_an_abort_with_a_client_error_status_is_permanent():
    """SGLang aborts a prompt at the context limit with status 400: bad input, never re-issued
    (it used to come back as an ordinary abort and be tried again forever)."""
    from asyncrl.engine.replies import parse_completion

    reply = {
        "output_ids": [],
        "meta_info": {
            "finish_reason": {"type": "abort", "message": "input too long", "status_code": 400},
            "weight_version": "default",
            "prompt_tokens": 8,
            "output_token_logprobs": [],
        },
    }

    class OneReply:  # the engine edge: answers every request with `reply`
        async def generate_one(self, request):
            return parse_completion("http://engine", reply, True)

    request = {"input_ids": [1] * 8, "sampling_params": {"max_new_tokens": 4}}
    with pytest.raises(PermanentRolloutError, match="input too long"):
        asyncio.run(generate_continued(OneReply(), request, 4))


def test_a_session_left_open_by_a_failed_sync_is_closed_before_the_next(tmp_path):
    """0.5.23 refuses a second /begin_weight_update while one is open: a sync that failed
    half-way must not block every later one."""
    handle = start_fake(tmp_path, "0.5.23", delay=0.0)

    async def go():
        async with EngineClient(handle.url) as client:
            sender = WeightSender(group_name="reopen", timeout_s=30)
            await sender.init_group([client], backend="gloo")
            await client.begin_weight_update()  # what the failed sync left behind
            await sender.sync([("w", torch.ones(2))], 2, load_format=None, pause_mode="abort")
            await sender.close()

    try:
        asyncio.run(go())
        got = state(handle.url)
        paths = [p for p, _ in got["calls"]]
        assert got["version"] == "2" and paths.count("/end_weight_update") == 2
    finally:
        handle.stop()


def test_a_batched_first_reply_cut_by_an_abort_is_continued_from_its_partial_output():
    """A group's first replies come from one batched request; an aborted one is continued
    alone (prompt + partial output, the rest of the budget) and keeps its partial tokens'
    logprobs and versions."""
    from asyncrl.engine.replies import parse_completion

    def reply(ids: list[int], finish: str, version: str) -> dict:
        meta = {"finish_reason": {"type": finish}, "weight_version": version,
                "prompt_tokens": 2, "output_token_logprobs": [[-0.5, t, None] for t in ids]}  # fmt: skip
        return {"output_ids": ids, "meta_info": meta}

    class Continues:  # the engine edge: records the continuation it is asked
        asked: list[dict] = []

        async def generate_one(self, request):
            self.asked.append(request)
            return parse_completion("http://engine", reply([9, 2], "stop", "4"), True)

    first = parse_completion("http://engine", reply([7, 8], "abort", "3"), True)
    request = {"input_ids": [1, 1], "sampling_params": {"max_new_tokens": 6}}
    engine = Continues()
    c = asyncio.run(generate_continued(engine, request, 6, first))
    assert [a["input_ids"] for a in engine.asked] == [[1, 1, 7, 8]]
    assert engine.asked[0]["sampling_params"]["max_new_tokens"] == 4
    assert c.output_ids == [7, 8, 9, 2] and c.token_versions() == [3, 3, 4, 4]
    assert c.finish_reason == "stop" and c.prompt_tokens == 2
    done = parse_completion("http://engine", reply([5, 2], "stop", "3"), True)
    engine.asked.clear()
    assert asyncio.run(generate_continued(engine, request, 6, done)).output_ids == [5, 2]
    assert engine.asked == []  # a finished first reply is not asked again

"""Request priority (SGLang's `priority` on /generate): the hf engine admits waiting requests by
it and lets background work (below 0: evaluation) yield to the rest, the hf server checks it, evaluation puts `logging.eval_priority` on its requests, and the
SGLang launcher turns priority scheduling on only when evaluation needs it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from asyncrl.config.schema import LoggingConfig
from asyncrl.data.prompts import PromptItem
from asyncrl.engine.client import EngineClient
from asyncrl.engine.hf import schedule
from asyncrl.engine.hf.batch import RequestError, SamplingParams, Seq
from asyncrl.engine.hf.engine import HFEngine
from asyncrl.engine.hf.protocol import parse_generate
from asyncrl.engine.sglang import SGLangConfigError, SGLangSettings, server_command, with_priority
from asyncrl.engine.versions import HF_SERVER_VERSION, profile_for
from asyncrl.rollout.evaluation import Evaluator
from asyncrl.rollout.settings import RolloutSettings
from tests.helpers import random_qwen2

DEADLINE_S = 60.0
LONG = 1500  # the filler's tokens: it holds the only batch slot until it is aborted


def _seq(rid: str, priority: int, done: list[str], cond: threading.Condition, n: int) -> Seq:
    def on_done(seq: Seq) -> None:
        with cond:
            done.append(seq.rid)
            cond.notify_all()

    params = SamplingParams.from_json({"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    return Seq(rid, [3, 4, 5], params, on_done, priority=priority)


def _wait_until(pred, what: str) -> None:
    """Poll engine state (deadline, no fixed sleep) until `pred()` holds."""
    deadline = time.monotonic() + DEADLINE_S
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.005)


@contextlib.contextmanager
def _engine(max_batch_size: int) -> Iterator[tuple[HFEngine, list[str], threading.Condition]]:
    """A running hf engine over a random model, the rids it finished (in order) and the
    condition notified at each; stopped on the way out."""
    engine = HFEngine(random_qwen2(), max_batch_size=max_batch_size, seed=0)
    engine.start()
    try:
        yield engine, [], threading.Condition()
    finally:
        engine.stop()


def test_hf_engine_admits_a_later_higher_priority_request_first_fifo_within_a_priority():
    with _engine(1) as (engine, done, cond):
        engine.submit(_seq("filler", 0, done, cond, LONG))
        # the filler holds the only slot: everything submitted from now on waits
        _wait_until(lambda: engine.load()["num_waiting_reqs"] == 0, "the filler to run")
        assert engine.load()["num_reqs"] == 1
        for rid, prio in (("low1", -1), ("mid1", 0), ("high1", 5), ("low2", -1), ("high2", 5)):
            engine.submit(_seq(rid, prio, done, cond, 2))
        assert engine.load()["num_waiting_reqs"] == 5  # all wait behind the full batch
        assert engine.abort("filler") == 1
        with cond:
            assert cond.wait_for(lambda: len(done) == 6, DEADLINE_S), done
        # one slot: each request finishes before the next is admitted, so the finish order is
        # the admission order: priority first, arrival within one; the lowest still runs
        assert done == ["filler", "high1", "high2", "mid1", "low1", "low2"]


def test_retracted_requests_keep_their_place_within_their_priority():
    with _engine(1) as (engine, done, cond):
        engine.submit(_seq("first", 0, done, cond, 40))
        _wait_until(lambda: engine.load()["num_waiting_reqs"] == 0, "the first request to run")
        engine.submit(_seq("second", 0, done, cond, 2))
        engine.submit(_seq("eval", -1, done, cond, 2))
        engine.pause("retract")  # `first` goes back to the head of the queue
        engine.resume()
        with cond:
            assert cond.wait_for(lambda: len(done) == 3, DEADLINE_S), done
        assert done == ["first", "second", "eval"]


def _rows(*priorities: int) -> list[Seq]:
    return [Seq(f"r{i}", [3], None, None, priority=p) for i, p in enumerate(priorities)]


def test_background_requests_are_admitted_when_no_foreground_row_runs_else_a_share():
    """Below priority 0 is background: beside a running or just-admitted foreground row only a
    quarter of BACKGROUND_ADMIT every BACKGROUND_EVERY-th step; otherwise BACKGROUND_ADMIT a
    step; half the batch in all."""
    ev, every, cap = _rows(*[-1] * 200), schedule.BACKGROUND_EVERY, schedule.BACKGROUND_ADMIT
    assert schedule.admit(ev, [], 256, busy=True, step=1) == []  # a foreground row runs
    assert schedule.admit(ev, [], 256, busy=True, step=every) == ev[: cap // 4]  # its share
    mixed = [*ev[:3], *_rows(0, 0)]
    got = schedule.admit(mixed, [], 256, busy=False, step=1)
    assert [s.priority for s in got] == [0, 0]  # admitted now: the background waits
    got = schedule.admit(mixed, [], 256, busy=False, step=every)
    assert [s.priority for s in got] == [0, 0, -1, -1, -1]
    assert schedule.admit(ev, [], 256, busy=False, step=1) == ev[:cap]
    # 100 background rows hold slots already (and a foreground one in a paused lane): to half
    assert len(schedule.admit(ev, _rows(*[-1] * 100, 0), 256, busy=False, step=1)) == 28
    assert schedule.admit(ev, _rows(*[-1] * 128), 256, busy=False, step=every) == []
    full = _rows(*[-1] * 255)
    assert schedule.admit(_rows(0, 5, 0), full, 256, busy=False, step=1)[0].priority == 5
    assert len(schedule.admit(_rows(0, 0), _rows(*[0] * 255), 256, busy=True, step=1)) == 1
    # a share step keeps its slots even from a foreground queue longer than the free slots
    queue = _rows(-1, 0, 0, 0)
    assert [s.rid for s in schedule.admit(queue, _rows(*[0] * 6), 8, True, every)] == ["r1", "r0"]
    assert schedule.admit(queue, _rows(*[0] * 6), 8, True, 1) == queue[1:3]
    # a batch of 1 keeps strict priority: no share while foreground waits
    assert schedule.admit(_rows(-1, 0), [], 1, busy=False, step=every)[0].priority == 0


def test_a_background_only_lane_decodes_every_few_steps_while_foreground_rows_run():
    rollout = SimpleNamespace(running=_rows(0, -1))  # a mixed lane counts as foreground
    evaluation = SimpleNamespace(running=_rows(-1, -1))
    idle = SimpleNamespace(running=[])
    every = schedule.BACKGROUND_EVERY
    due = [
        schedule.due_lanes([rollout, evaluation, idle], step) for step in range(1, 2 * every + 1)
    ]
    assert [evaluation in d for d in due].count(True) == 2  # steps every, 2 * every
    assert all(rollout in d for d in due)
    assert schedule.due_lanes([evaluation, idle], 1) == [evaluation, idle]  # nothing to yield to


def test_hf_engine_never_starves_background_work_beside_busy_foreground_work():
    """An evaluation request queued while a long rollout request keeps the engine busy joins
    it in a shared step and finishes first; the rollout request runs on undisturbed."""
    with _engine(8) as (engine, done, cond):
        engine.submit(_seq("rollout", 0, done, cond, LONG))
        _wait_until(lambda: engine.load()["num_waiting_reqs"] == 0, "the rollout row to run")
        engine.submit(_seq("eval", -1, done, cond, 2))
        with cond:
            assert cond.wait_for(lambda: done == ["eval"], DEADLINE_S), done
        assert engine.load()["num_reqs"] == 1  # the rollout request is still running
        assert engine.abort("rollout") == 1


def test_generate_body_priority_is_checked():
    def parse(extra: dict) -> list[Seq]:
        return parse_generate({"input_ids": [1, 2], **extra}, lambda s: None)[0]

    assert parse({})[0].priority == 0
    assert parse({"priority": None})[0].priority == 0
    assert parse({"priority": -3})[0].priority == -3
    batch = parse_generate({"input_ids": [[1], [2]], "priority": [2, -1]}, lambda s: None)[0]
    assert [s.priority for s in batch] == [2, -1]
    for bad, match in (
        (1.5, "priority must be int"),
        (True, "priority must be int"),
        ("1", "priority must be int"),
        (1 << 63, "signed 64-bit"),
    ):
        with pytest.raises(RequestError, match=match):
            parse({"priority": bad})


def _evaluator(
    tiny_model,
    priority: int | None,
    logging: LoggingConfig | None = None,
    kept: int | None = None,
    linger_s: float = 0.0,
) -> tuple[Evaluator, list[dict]]:
    """A real Evaluator whose engine edge (the HTTP call) records each body and answers it;
    `logging` instead of the default one at `priority`; `kept`: the engine is an hf server
    that keeps that many pinned versions (None: one that keeps none, as SGLang), leased for
    `linger_s`."""
    sent: list[dict] = []
    client = EngineClient("http://127.0.0.1:9")

    async def call_ok(method, path, body=None, timeout_s=None):
        sent.append(body)
        meta = {"finish_reason": {"type": "length"}, "weight_version": "3", "prompt_tokens": 2}
        meta |= {"output_token_weight_versions": ["3"], "output_token_logprobs": [[-0.1, 5, None]]}
        one = {"output_ids": [5], "meta_info": meta}
        batched = isinstance(body["input_ids"][0], list)  # SGLang's list form: a list back
        return [one] * len(body["input_ids"]) if batched else one

    client.http.call_ok = call_ok
    info = {"max_pinned_versions": kept or 0, "pinned_version_linger_s": linger_s}
    client._profile = profile_for(HF_SERVER_VERSION, info)
    if logging is None:
        logging = LoggingConfig() if priority is None else LoggingConfig(eval_priority=priority)
    settings = RolloutSettings(["http://127.0.0.1:9"], "127.0.0.1", 1, str(tiny_model))
    items = [PromptItem(f"k{i}", [1, 2], "1+1") for i in range(2)]
    fleet = SimpleNamespace(clients=[client], eval_clients=lambda: [client], eval_index=None)
    return Evaluator(logging, 10, items, settings, fleet), sent


def evaluate_once(ev: Evaluator, version: int = 3) -> tuple[list[list[int]], float]:
    """What `Evaluator.submit` runs for one evaluation, on a loop of its own: pin, generate."""

    async def run() -> tuple[list[list[int]], float]:
        clients = ev.fleet.eval_clients()
        return await ev._generate(clients, version, await ev._pin(clients, version))

    return asyncio.run(run())


def test_evaluation_requests_carry_eval_priority_and_parse_on_the_hf_server(tiny_model):
    ev, sent = _evaluator(tiny_model, None)
    outs, _ = evaluate_once(ev)
    assert outs == [[5], [5]] and len(sent) == 1  # both prompts in one batched request
    assert sent[0]["input_ids"] == [[1, 2], [1, 2]]
    assert all(body["priority"] == -1 for body in sent)  # default: below rollout's 0
    parsed, batched = parse_generate(sent[0], lambda s: None)
    assert batched and [seq.priority for seq in parsed] == [-1, -1]
    ev, sent = _evaluator(tiny_model, 0)
    evaluate_once(ev)
    assert all("priority" not in body for body in sent)  # same priority as rollout: none sent


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_evaluation_body_fits_sglangs_generate_struct(tiny_model, version):
    from tests.fake_sglang.wheel_structs import load_module, read_structs, violations
    from tests.test_sglang_contract import wheel

    whl = wheel(version)
    structs = read_structs(whl.read("sglang/srt/managers/io_struct.py").decode())
    ev, sent = _evaluator(tiny_model, -1)
    evaluate_once(ev)
    assert violations(structs["GenerateReqInput"], sent[0]) == []
    assert violations(structs["GenerateReqInput"], {**sent[0], "priority": "low"})  # live
    if "sglang/api/v1/api_types.py" in whl.namelist():
        load_module(whl, "sglang/api/v1/api_types.py").GenerateRequest.from_json_value(sent[0])


def test_sglang_launch_turns_priority_scheduling_on_only_when_eval_priority_differs(tmp_path):
    base = SGLangSettings.parse({})
    assert with_priority(base, 0, "0.5.23") is base
    assert with_priority(base, None, "0.5.23") is base
    on = with_priority(base, -1, "0.5.23")
    cmd = server_command(tmp_path, 30000, 1, on)
    assert "--enable-priority-scheduling" in cmd
    assert cmd[cmd.index("--default-priority-value") + 1] == "0"
    assert "--enable-priority-scheduling" not in server_command(tmp_path, 30000, 1, base)
    with pytest.raises(SGLangConfigError, match="eval_priority=-1 .* 0.5.6 has no"):
        with_priority(base, -1, "0.5.6")
    with pytest.raises(SGLangConfigError, match="schedule_policy 'lpm'"):
        with_priority(SGLangSettings.parse({"schedule_policy": "lpm"}), -1, "0.5.23")
    attached = SGLangSettings.parse({"server_urls": ["http://127.0.0.1:1"]})
    assert with_priority(attached, -1, "0.5.6") is attached

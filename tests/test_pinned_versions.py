"""Requests pinned to a weight version (`pin_weight_version`, `logging.eval_sync: pinned`): the
hf engine serves them from a kept copy of their version across weight changes and pauses, the
server and client carry the field, and the evaluator pins its requests and lets a sync go
ahead while no more evaluations are unfinished than the engines keep versions for."""

from __future__ import annotations

import concurrent.futures
import copy
import threading
import time

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.config.schema import LoggingConfig
from asyncrl.engine.hf.batch import RequestError, SamplingParams, Seq
from asyncrl.engine.hf.engine import HFEngine
from asyncrl.engine.hf.protocol import parse_generate
from asyncrl.engine.versions import HF_SERVER_VERSION, PIN_KEY, profile_for
from asyncrl.rollout.evaluation import Evaluator, _InFlight
from tests.helpers import random_qwen2
from tests.test_priority import _evaluator as priority_evaluator
from tests.test_priority import evaluate_once

DEADLINE_S = 60.0
LONG = 200  # tokens a request runs for: far more than pass between two looks at it
FOREVER = 4000  # a request that outlives the test unless it is ended


class Done:
    """Finished requests by rid, and a condition to wait on them."""

    def __init__(self) -> None:
        self.seqs: dict[str, Seq] = {}
        self.cond = threading.Condition()

    def seq(self, rid: str, pin: str | None, n: int = LONG, prompt=(3, 4, 5)) -> Seq:
        def on_done(seq: Seq) -> None:
            with self.cond:
                self.seqs[seq.rid] = seq
                self.cond.notify_all()

        js = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
        return Seq(rid, list(prompt), SamplingParams.from_json(js), on_done, True, pin=pin)

    def wait(self, *rids: str) -> None:
        with self.cond:
            ok = self.cond.wait_for(lambda: all(r in self.seqs for r in rids), DEADLINE_S)
        assert ok, f"timed out waiting for {rids}; done: {sorted(self.seqs)}"


def _until(pred, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.002)


def _between_steps(engine: HFEngine, running: list[Seq], act) -> None:
    """`act()` under the step lock, once every one of `running` has sampled a token (and none
    has finished: each runs far longer than one look takes)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        with engine.step_lock:
            if all(s.output_ids for s in running):
                assert all(s.finish is None for s in running), [s.finish for s in running]
                act()
                return
        assert time.monotonic() < deadline, "timed out waiting for the requests to run"
        threading.Event().wait(0.001)


def _change_weights(engine: HFEngine, version: str, seed: int) -> None:
    """What a weight load does, between two steps: keep the pinned, change, set the version."""
    gen = torch.Generator().manual_seed(seed)
    with engine.step_lock, torch.no_grad():
        engine.keep_pinned()
        for p in engine.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
        engine.weight_version = version


def _engine(max_kept: int = 1, batch: int = 8) -> HFEngine:
    engine = HFEngine(random_qwen2(), max_batch_size=batch, seed=0, max_pinned_versions=max_kept)
    engine.weight_version = "1"
    engine.start()
    return engine


def _reference(model: torch.nn.Module, n: int = LONG) -> Seq:
    """The same greedy request, unpinned, on an engine that only ever held `model`."""
    engine = HFEngine(model, max_batch_size=1, seed=0)
    done = Done()
    engine.start()
    try:
        engine.submit(done.seq("ref", None, n))
        done.wait("ref")
    finally:
        engine.stop()
    return done.seqs["ref"]


def test_a_pinned_request_finishes_on_its_version_while_the_live_weights_change():
    engine, done = _engine(), Done()
    original = copy.deepcopy(engine.model)
    try:
        seqs = [done.seq("pinned", "1"), done.seq("live", None)]
        for seq in seqs:
            engine.submit(seq)
        _between_steps(engine, seqs, lambda: _change_weights(engine, "2", seed=1))
        assert engine.kept_versions() == ["1"]
        done.wait("pinned", "live")
        _until(lambda: engine.kept_versions() == [], "the kept copy to be dropped")
    finally:
        engine.stop()
    pinned, live = done.seqs["pinned"], done.seqs["live"]
    assert pinned.error is None and pinned.weight_version == "1"
    assert set(pinned.token_versions) == {"1"} and len(pinned.output_ids) == LONG
    # every token of the pinned one is what the old weights alone generate, logprobs included
    ref = _reference(original)
    assert pinned.output_ids == ref.output_ids
    assert pinned.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    # the unpinned one moved on to the new weights mid-way, as rollout requests do
    assert live.token_versions[0] == "1" and live.token_versions[-1] == "2"
    assert live.weight_version == "2"


def test_a_pin_the_engine_cannot_serve_is_refused_in_one_line():
    engine, done = _engine(), Done()
    try:
        with pytest.raises(ValueError, match="pin_weight_version 7 is not served: it serves 1"):
            engine.check(done.seq("x", "7"))
        with engine.step_lock:  # the live weights are being replaced: no new pin on them
            engine.keep_pinned()
        with pytest.raises(ValueError, match=r"serves none \(1 updating\)"):
            engine.check(done.seq("x", "1"))
        engine.check(done.seq("x", None))  # unpinned requests still queue
        engine.weight_version = "2"
        engine.check(done.seq("x", "2"))
    finally:
        engine.stop()


def test_an_engine_that_keeps_no_version_fails_the_pinned_request_at_the_change():
    engine, done = _engine(max_kept=0), Done()
    try:
        seq = done.seq("pinned", "1", n=FOREVER)
        engine.submit(seq)
        _between_steps(engine, [seq], lambda: _change_weights(engine, "2", seed=1))
        done.wait("pinned")
    finally:
        engine.stop()
    assert "weight version 1 replaced (this engine keeps none)" in done.seqs["pinned"].error


def test_past_the_cap_the_oldest_kept_version_is_dropped_and_the_newer_one_finishes():
    engine, done = _engine(max_kept=1), Done()
    try:
        v1, v2 = done.seq("v1", "1", n=FOREVER), done.seq("v2", "2")
        engine.submit(v1)
        _between_steps(engine, [v1], lambda: _change_weights(engine, "2", seed=1))
        engine.submit(v2)
        # v2 needs a kept copy: v1's goes
        _between_steps(engine, [v1, v2], lambda: _change_weights(engine, "3", seed=2))
        done.wait("v1", "v2")
        assert engine.kept_versions() in (["2"], [])
    finally:
        engine.stop()
    assert "weight version 1 dropped: 1 kept at most" in done.seqs["v1"].error
    v2 = done.seqs["v2"]
    assert v2.error is None and set(v2.token_versions) == {"2"} and len(v2.output_ids) == LONG


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_a_pause_leaves_pinned_requests_running_on_their_kept_version(mode):
    """A pause (which precedes every update) moves the pinned requests to a kept copy, which
    goes on decoding while the live weights are paused; abort ends only the others."""
    engine, done = _engine(), Done()
    try:
        seqs = [done.seq("pinned", "1"), done.seq("live", None, n=FOREVER)]
        for seq in seqs:
            engine.submit(seq)
        _between_steps(engine, seqs, lambda: engine.pause(mode))
        done.wait("pinned")  # finished while the engine is still paused
        assert engine.paused
        if mode == "abort":
            done.wait("live")
            assert done.seqs["live"].finish["type"] == "abort"
        else:
            assert "live" not in done.seqs
            held = len(seqs[1].output_ids)  # paused: it stopped there, KV kept or retracted
            engine.resume()
            _until(lambda: len(seqs[1].output_ids) > held, "the live request to go on")
            engine.abort("live")
            done.wait("live")
    finally:
        engine.stop()
    pinned = done.seqs["pinned"]
    assert pinned.finish["type"] == "length" and set(pinned.token_versions) == {"1"}


def test_the_generate_field_and_the_servers_profile():
    def pins(body: dict) -> list[str | None]:
        return [s.pin for s in parse_generate({"input_ids": [[1], [2]], **body}, print)[0]]

    assert pins({}) == [None, None]
    assert pins({PIN_KEY: 3}) == ["3", "3"] and pins({PIN_KEY: "4"}) == ["4", "4"]
    assert pins({PIN_KEY: ["5", None]}) == ["5", None]
    for bad in ("v5", 1.5, True):
        with pytest.raises(RequestError, match=PIN_KEY):
            pins({PIN_KEY: bad})
    assert profile_for(HF_SERVER_VERSION, {"max_pinned_versions": 2}).pinned_versions == 2
    assert profile_for(HF_SERVER_VERSION, {"max_pinned_versions": "x"}).pinned_versions == 0
    assert profile_for(HF_SERVER_VERSION).pinned_versions == 0
    assert profile_for("0.5.23", {"max_pinned_versions": 2}).pinned_versions == 0  # SGLang


def _evaluator(
    tiny_model, eval_sync: str, kept: int, linger_s: float = 0.0
) -> tuple[Evaluator, list[dict]]:
    return priority_evaluator(tiny_model, -1, LoggingConfig(eval_sync=eval_sync), kept, linger_s)


@pytest.mark.parametrize(("eval_sync", "kept", "pinned"), [
    ("pinned", 1, True), ("pinned", 0, False), ("wait", 1, False), ("auto", 1, True),
    ("auto", 0, False),
])  # fmt: skip
@pytest.mark.parametrize("linger_s", [0.0, 5.0])
def test_evaluation_pins_its_requests_only_when_asked_and_kept(
    tiny_model, eval_sync, kept, pinned, linger_s
):
    """Pinned where asked and the engines keep versions; where they also lease them, a pinned
    request of no tokens holds the version first (the hf server parses it)."""
    ev, sent = _evaluator(tiny_model, eval_sync, kept, linger_s)
    outs, _ = evaluate_once(ev)
    leased = pinned and linger_s > 0
    lease, body = sent if leased else [None, *sent]
    assert outs == [[5], [5]] and len(sent) == 1 + leased
    assert (body.get(PIN_KEY) == "3") if pinned else PIN_KEY not in body
    assert ev.kept_versions == (kept if eval_sync != "wait" else 0)
    if pinned:  # and the hf server reads it back
        assert [s.pin for s in parse_generate(body, print)[0]] == ["3", "3"]
    if leased:
        [seq] = parse_generate(lease, print)[0]
        assert seq.pin == "3" and seq.params.max_new_tokens == 0


def test_a_sync_waits_only_for_the_evaluations_beyond_what_the_engines_keep(tiny_model):
    ev, _ = _evaluator(tiny_model, "pinned", 1)
    old, new = concurrent.futures.Future(), concurrent.futures.Future()
    ev.in_flight = [_InFlight(5, 5, 0.0, old), _InFlight(10, 10, 0.0, new)]
    ev.kept_versions = 1
    finisher = threading.Timer(0.05, old.set_result, [([[5]], 0.0)])
    finisher.start()
    ev.wait_before_sync()  # two unfinished, one kept: waits for the oldest alone
    assert old.done() and not new.done()
    assert ev.wait_before_sync() == pytest.approx(0.0, abs=0.05)  # one left: no wait
    new.set_result(([[5]], 0.0))
    ev.kept_versions = 0  # `wait`, or engines that keep none: every one must be done
    late = concurrent.futures.Future()
    ev.in_flight.append(_InFlight(15, 15, 0.0, late))
    threading.Timer(0.05, late.set_result, [([[5]], 0.0)]).start()
    ev.wait_before_sync()
    assert late.done()
    finisher.join()


def test_pinned_evaluation_is_refused_for_engines_that_hold_one_version():
    with pytest.raises(ConfigError, match="eval_sync: pinned needs hf_infer"):
        load_config(
            None, ["logging.eval_sync=pinned", "actor_infer.strategy_args.strategy_name=sglang"]
        )
    assert load_config(None, ["logging.eval_sync=pinned"]).logging.eval_sync == "pinned"
    sglang = ["actor_infer.strategy_args.strategy_name=sglang"]  # auto: waits there, no error
    assert load_config(None, sglang).logging.eval_sync == "auto"

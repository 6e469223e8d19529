"""Mixture-of-experts routes end to end: the hf engine records each position's experts, they
travel in the wire record and checkpoints, and the learner replays them (R3) exactly.

The engine and the learner run in fp32 on the same weights here, so the learner's own routing
already agrees with the engine's: what is checked is that the replayed experts ARE the
recorded ones (recorded again inside the replayed forward), that nothing differs, that
gradients still reach the routers, and that a request prefilled again after a retract keeps
the routes it was sampled with. The bf16-engine mismatch that R3 removes is measured by
`bench/mismatch.py`, and held by `test_moe_mismatch.py`.
"""

from __future__ import annotations

import base64
import threading
import time

import numpy as np
import pytest
import torch

from asyncrl import moe
from asyncrl.config import ConfigError, load_config
from asyncrl.engine.hf import routes as engine_routes
from asyncrl.engine.hf.batch import SamplingParams, Seq
from asyncrl.engine.hf.engine import HFEngine
from asyncrl.engine.replies import EngineReplyError, parse_routes
from asyncrl.learner.collate import collate
from asyncrl.learner.logprobs import token_logprobs
from asyncrl.learner.torch.learner import TorchLearner
from asyncrl.rollout.single_turn import keep_routes
from asyncrl.transport.batch import decode_groups, encode_batch
from asyncrl.transport.codec import decode_group, encode_group
from asyncrl.transport.frames import DecodeError
from asyncrl.transport.stored import group_from_bytes, group_to_bytes
from asyncrl.types import UNROUTED, RecordError, TrajectoryGroup
from tests.moe_fixtures import random_moe

PROMPTS = [[20, 21, 22], [30, 31, 32, 33, 34], [40, 41]]
NEW = 7


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    random_moe(path)
    return path


def _bad(problem: str) -> EngineReplyError:
    return EngineReplyError("http://engine", problem)


def _generate(model, prompts, new=NEW, on_engine=None) -> list[Seq]:
    """`prompts` through an in-process hf engine (fp32), routes asked for; `on_engine(engine,
    seqs)` runs while they generate."""
    engine = HFEngine(model, max_batch_size=8, seed=3)
    done, out = threading.Event(), []

    def finished(seq: Seq) -> None:
        out.append(seq)
        if len(out) == len(prompts):
            done.set()

    params = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True)
    seqs = [Seq(f"r{i}", list(p), params, finished, True, return_routes=True)
            for i, p in enumerate(prompts)]  # fmt: skip
    engine.start()
    try:
        engine.submit(*seqs)
        if on_engine is not None:
            on_engine(engine, seqs)
        assert done.wait(60), "the engine did not finish"
    finally:
        engine.stop()
    assert all(s.error is None for s in seqs), [s.error for s in seqs]
    return seqs


def _group(seqs: list[Seq], gid: str = "g") -> TrajectoryGroup:
    """The group a rollout worker builds of these replies (routes through the reply codec)."""
    responses = []
    for s in seqs:
        rows = len(s.prompt) + len(s.output_ids) - 1
        routes = parse_routes(engine_routes.reply_field(s), rows, _bad)
        responses.append({
            "response_ids": s.output_ids, "rollout_logprobs": s.logprobs,
            "versions": [0] * len(s.output_ids), "reward": float(len(s.output_ids) % 2),
            "finish_reason": "length", "routes": routes, "advantages": [1.0] * len(s.output_ids),
        })  # fmt: skip
    assert len({tuple(s.prompt) for s in seqs}) == 1
    return TrajectoryGroup.from_responses(gid, seqs[0].prompt, responses)


def _learner(model_dir, *overrides) -> TorchLearner:
    cfg = load_config(None, [
        "actor_train.training_args.learning_rate=1e-2",
        "actor_train.model_args.disable_gradient_checkpointing=true",
        "actor.router_replay=r3", f"actor_train.model_args.model_name_or_path={model_dir}",
        *overrides,
    ])  # fmt: skip
    return TorchLearner(model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, temperature=1.0,
                        total_steps=4)  # fmt: skip


def test_the_tap_is_transformers_router_arithmetic_and_replay_keeps_router_gradients():
    model = random_moe()
    ids = torch.randint(4, 90, (3, 9))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    tap = moe.install(model)
    with torch.no_grad(), tap.recording_routes():
        assert torch.equal(model(input_ids=ids).logits, reference)
    routes = tap.take()
    assert routes.shape == (27, 2, 2) and routes.dtype == torch.uint8
    other = (routes.long() + 1) % 8  # other experts everywhere: a different forward
    with tap.replaying(other.view(3, 9, 2, 2)), tap.recording_routes():
        out = model(input_ids=ids).logits
        assert torch.equal(tap.take(), other.to(torch.uint8))
    assert not torch.allclose(out, reference)
    out.float().logsumexp(-1).sum().backward()
    for router in moe.routers(model):  # the router's probabilities weigh the replayed experts
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert tap.reset_stats()["differ"] > 0
    with pytest.raises(moe.RoutesError, match="expert >= 8"):
        with tap.replaying(torch.full((27, 2, 2), 9)):
            pass


def test_engine_routes_are_what_the_learner_replays_through_wire_and_checkpoint(moe_dir):
    model = random_moe()
    groups = []
    for k, prompt in enumerate(PROMPTS):
        seqs = _generate(model, [prompt] * 3)
        group = _group(seqs, f"g{k}")
        for i, s in enumerate(seqs):  # the reply's rows: prompt + output - 1, then UNROUTED
            block = group.route_block(i)
            assert len(block) == len(s.prompt) + len(s.output_ids)
            assert (block[-1] == UNROUTED).all() and (block[:-1] != UNROUTED).all()
        groups.append(group)
    # the wire (one group, a batch) and a checkpoint's stored bytes carry them unchanged
    assert decode_group(encode_group(groups[0])) == groups[0]
    assert all(a == b for a, b in zip(decode_groups(encode_batch(groups)), groups, strict=True))
    restored = [group_from_bytes(group_to_bytes(g)) for g in groups]
    assert all(a == b for a, b in zip(restored, groups, strict=True))

    learner = _learner(moe_dir)
    data = collate(restored, learner.pad_id).to_torch()
    tap = moe.tap_of(learner.model)
    with torch.no_grad(), tap.recording_routes():
        logp, _ = token_logprobs(learner.model, data, temperature=1.0)
        replayed = tap.take().view(*data["input_ids"].shape, -1)
    given = data["routes"]
    routed = given != UNROUTED
    assert int(routed.sum()) > 0
    assert torch.equal(replayed[routed], given[routed])  # exactly the engine's experts
    stats = tap.reset_stats()
    assert stats["replayed"] > 0 and stats["differ"] == 0
    mask = data["response_mask"] > 0
    torch.testing.assert_close(logp[mask], data["rollout_logprobs"][mask], atol=2e-5, rtol=0)

    before = [r.weight.detach().clone() for r in moe.routers(learner.model)]
    metrics = learner.step(restored)
    assert metrics["learner/router_replayed_frac"] > 0.5
    assert metrics["learner/router_differ_frac"] == 0.0
    after = [r.weight for r in moe.routers(learner.model)]
    assert all(not torch.equal(a, b) for a, b in zip(after, before, strict=True))  # it learned


def test_a_retracted_request_keeps_the_routes_it_was_sampled_with():
    model = random_moe(seed=1)
    old = engine_weights(model)
    held = {}

    def retract_and_reroute(engine: HFEngine, seqs: list[Seq]) -> None:
        deadline = time.monotonic() + 30
        while len(seqs[0].output_ids) < 5:  # mid-generation, by its own count
            assert time.monotonic() < deadline, "the request made no progress"
            time.sleep(0.001)
        engine.pause("retract")  # its KV dropped; re-prefilled (prompt + output) after resume
        held["n"] = len(seqs[0].output_ids)
        with engine.step_lock, torch.no_grad():  # new weights: every router sends elsewhere
            for router in moe.routers(engine.model):
                router.weight.copy_(router.weight.roll(1, dims=0))
        engine.resume()

    (seq,) = _generate(model, [PROMPTS[1]], new=40, on_engine=retract_and_reroute)
    got = torch.cat(seq.routes)
    tokens = torch.tensor([seq.tokens()[:-1]])
    assert len(got) == tokens.shape[1]
    fresh = random_moe(seed=1)
    tap = moe.install(fresh)
    expect = {}
    for name, weights in (("old", old), ("new", dict(engine_weights(model)))):
        fresh.load_state_dict(weights)
        with torch.no_grad(), tap.recording_routes():
            fresh(input_ids=tokens)
        expect[name] = tap.take()
    cut = len(seq.prompt) + held["n"] - 1  # positions forwarded before the retract
    assert torch.equal(got[:cut], expect["old"][:cut])  # kept, not overwritten by the prefill
    assert torch.equal(got[cut:], expect["new"][cut:])
    assert not torch.equal(expect["old"][:cut], expect["new"][:cut])  # the test can fail


def engine_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def test_a_continued_sample_keeps_its_first_replys_routes():
    first = np.arange(12, dtype=np.uint8).reshape(6, 2)
    again = np.full((9, 2), 7, np.uint8)  # its prefill re-routed positions 0..5 (new weights)
    kept = keep_routes(keep_routes(None, first), again)
    assert np.array_equal(kept[:6], first) and np.array_equal(kept[6:], again[6:])
    assert keep_routes(np.zeros((0, 1), np.uint8), again) is again  # aborted before its prefill


def test_route_replies_are_checked():
    ids = np.array([[[1, 2], [3, 4]], [[5, 6], [7, 0]]], dtype=np.int32)
    text = base64.b64encode(ids.tobytes()).decode()
    assert parse_routes(text, 2, _bad).tolist() == [[1, 2, 3, 4], [5, 6, 7, 0]]
    for value, rows, problem in [
        (None, 2, "not a base64 string"),
        ("@@@", 2, "not valid base64"),
        (text, 3, "not a multiple of 3 positions"),
        (base64.b64encode(np.array([300], np.int32).tobytes()).decode(), 1, "outside"),
    ]:
        with pytest.raises(EngineReplyError, match=problem):
            parse_routes(value, rows, _bad)


def test_route_records_are_checked_on_receipt():
    good = TrajectoryGroup.from_responses("g", [5, 6], [{
        "response_ids": [1, 2], "rollout_logprobs": [-1.0, -1.0], "versions": [0, 0],
        "reward": 1.0, "finish_reason": "stop", "routes": np.ones((3, 4), np.uint8),
    }])  # fmt: skip
    assert good.routes.shape == (4, 4) and (good.routes[3] == UNROUTED).all()
    with pytest.raises(RecordError, match=r"routes must be uint8 \[4, layers \* top_k\]"):
        TrajectoryGroup(**{**_fields(good), "routes": np.ones((5, 4), np.uint8)})
    frames = encode_group(good)
    frames[-1] = bytes(frames[-1])[:-1]  # the routes' frame one byte short
    with pytest.raises(DecodeError, match="'routes'"):
        decode_group(frames)


def _fields(g: TrajectoryGroup) -> dict:
    keys = (
        "group_id",
        "prompt_ids",
        "response_lengths",
        "response_ids",
        "rollout_logprobs",
        "loss_mask",
        "versions",
        "rewards",
        "finish_reasons",
        "advantages",
        "metadata",
    )
    return {k: getattr(g, k) for k in keys}


@pytest.mark.parametrize(
    "overrides,problem",
    [
        (["actor.router_replay=r2"], "r2 needs a mixture-of-experts policy"),
        (["actor.router_replay=r3"], "the embedded model is dense"),
        (["actor.router_replay=r3", "actor_train.model_args.embedded_arch=moe",
          "actor.use_dynamic_bsz=true"], "packed one"),
        (["actor.router_replay=r3", "actor_train.model_args.embedded_arch=moe",
          "actor_infer.strategy_args.strategy_name=sglang"], "enable_return_routed_experts"),
        (["actor.router_replay=r3", "actor_train.model_args.embedded_arch=moe",
          "actor_infer.strategy_args.strategy_name=sglang",
          "actor_infer.strategy_args.strategy_config.enable_return_routed_experts=true",
          "actor_infer.strategy_args.strategy_config.router=true"], "router drops"),
        (["actor.router_replay=r3", "actor_train.model_args.embedded_arch=moe",
          "actor_train.model_args.disable_gradient_checkpointing=false"], "checkpointing off"),
        (["actor.router_replay=r3", "actor_train.model_args.embedded_arch=moe",
          "actor.use_torch_compile=true"], "use_torch_compile"),
        (["actor_train.model_args.embedded_arch=moe",
          "actor_train.model_args.model_name_or_path=/x"], "empty model_name_or_path"),
        (["actor_infer.model_args.embedded_arch=moe"], "read on actor_train only"),
    ],
)  # fmt: skip
def test_moe_settings_a_run_cannot_honour_are_refused(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(None, overrides)


def test_r3_with_sglang_engines_launched_to_return_routes_validates():
    cfg = load_config(None, ["actor.router_replay=r3", "actor_train.model_args.embedded_arch=moe",
                             "actor_infer.strategy_args.strategy_name=sglang",
                             "actor_infer.strategy_args.strategy_config."
                             "enable_return_routed_experts=true"])  # fmt: skip
    assert cfg.actor.router_replay == "r3"


def test_r3_on_a_dense_model_directory_is_refused(tmp_path):
    from tests.helpers import random_qwen2

    random_qwen2(tmp_path)
    with pytest.raises(ConfigError, match="'qwen2'"):
        load_config(None, ["actor.router_replay=r3",
                           "actor_train.model_args.disable_gradient_checkpointing=true",
                           f"actor_train.model_args.model_name_or_path={tmp_path}"])  # fmt: skip


def test_the_moe_model_has_its_own_cache_key_and_the_dense_key_is_unchanged():
    from asyncrl.models.tiny import DEFAULT_SPEC, embedded_spec

    assert embedded_spec() is DEFAULT_SPEC and DEFAULT_SPEC.digest() == "777d9d693780d553"
    moe_spec = embedded_spec(arch="moe")
    assert moe_spec.arch == "moe" and moe_spec.digest() != DEFAULT_SPEC.digest()
    assert embedded_spec(["frozenlake"], "moe").digest() not in (
        moe_spec.digest(), embedded_spec(["frozenlake"]).digest())  # fmt: skip


class _EngineOverCall:
    """`EngineClient.generate_one` without the HTTP in between: the body goes through the hf
    server's own request parser, the engine, its own reply builder and the client's parser."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine

    async def generate_one(self, body: dict):
        import asyncio

        from asyncrl.engine.hf.protocol import parse_generate
        from asyncrl.engine.hf.server import _reply
        from asyncrl.engine.replies import parse_completion

        loop = asyncio.get_running_loop()
        done = loop.create_future()
        (seq,), _ = parse_generate(body, lambda s: loop.call_soon_threadsafe(done.set_result, s))
        self.engine.submit(seq)
        reply = _reply(await done)
        return parse_completion("in-process", reply, True, body["return_routed_experts"])


def test_an_aborted_then_continued_sample_keeps_the_routes_it_was_sampled_with():
    import asyncio

    from asyncrl.rollout.single_turn import generate_continued

    model = random_moe(seed=2)
    old = engine_weights(model)
    engine = HFEngine(model, max_batch_size=4, seed=5)
    client = _EngineOverCall(engine)
    request = {
        "input_ids": PROMPTS[0],
        "return_logprob": True,
        "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 40, "temperature": 1.0, "ignore_eos": True},
    }
    held = {}

    def abort_and_reroute() -> None:
        deadline = time.monotonic() + 30
        while not engine.num_requests() or engine.load()["num_tokens"] < len(PROMPTS[0]) + 5:
            assert time.monotonic() < deadline, "the request made no progress"
            time.sleep(0.001)
        engine.pause("abort")  # answered now with its partial output; continued by the client
        held["n"] = engine.pauses["abort"]
        with engine.step_lock, torch.no_grad():
            for router in moe.routers(engine.model):
                router.weight.copy_(router.weight.roll(1, dims=0))
        engine.resume()

    async def go():
        first = asyncio.create_task(client.generate_one(request))
        await asyncio.to_thread(abort_and_reroute)
        reply = await first
        assert reply.finish_reason == "abort"
        held["m"] = len(reply.output_ids)
        return await generate_continued(client, request, 40, reply)

    engine.start()
    try:
        c = asyncio.run(go())
    finally:
        engine.stop()
    assert held["n"] == 1 and len(c.output_ids) == 40 and c.finish_reason == "length"
    tokens = torch.tensor([PROMPTS[0] + c.output_ids[:-1]])
    assert c.routed_experts.shape == (tokens.shape[1], 4)
    fresh = random_moe(seed=2)
    tap = moe.install(fresh)
    expect = {}
    for name, weights in (("old", old), ("new", engine_weights(model))):
        fresh.load_state_dict(weights)
        with torch.no_grad(), tap.recording_routes():
            fresh(input_ids=tokens)
        expect[name] = tap.take().flatten(1).numpy()
    got = c.routed_experts
    # the first reply's positions: the old weights' routes, though the continuation's prefill
    # routed them again with the new ones; every later position: the new weights'
    cut = len(PROMPTS[0]) + held["m"] - 1
    assert held["m"] >= 5
    assert np.array_equal(got[:cut], expect["old"][:cut])
    assert np.array_equal(got[cut:], expect["new"][cut:])
    assert not np.array_equal(expect["old"][:cut], expect["new"][:cut])  # the test can fail


def test_routes_asked_of_a_dense_model_are_refused():
    from tests.helpers import random_qwen2

    engine = HFEngine(random_qwen2(), max_batch_size=2)
    seq = Seq("r", [3, 4], SamplingParams(max_new_tokens=2), lambda s: None, return_routes=True)
    with pytest.raises(ValueError, match="return_routed_experts: this model has no mixture"):
        engine.submit(seq)


def test_a_batch_whose_routes_do_not_tile_its_groups_is_refused():
    groups = [
        TrajectoryGroup.from_responses(
            f"g{k}",
            [5, 6, 7],
            [
                {
                    "response_ids": [1, 2],
                    "rollout_logprobs": [-1.0, -1.0],
                    "versions": [0, 0],
                    "reward": 1.0,
                    "finish_reason": "stop",
                    "routes": np.ones((4, 4), np.uint8),
                }
            ],
        )  # fmt: skip
        for k in range(2)
    ]
    frames = encode_batch(groups)
    assert [g.routes.shape for g in decode_groups(frames)] == [(5, 4), (5, 4)]
    import msgspec

    header = msgspec.msgpack.decode(bytes(frames[0]))
    spec = header[2]["routes"]
    spec[2] = [9, 4]  # one position short of the groups' 2 x (3 + 2)
    frames[0] = msgspec.msgpack.encode(header)
    frames[spec[3]] = bytes(frames[spec[3]])[: 9 * 4]
    with pytest.raises(DecodeError, match="routes has 9 positions, not 10"):
        decode_groups(frames)
    with pytest.raises(Exception, match="routes of one width or none"):
        encode_batch([groups[0], TrajectoryGroup(**_fields(groups[1]))])

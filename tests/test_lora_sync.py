"""Adapter-only weight sync: a LoRA learner's adapter into a real hf server process over gloo.

The learner, the sender and the server are real; nothing is faked. The engine's per-token
logprobs after a sync must be the learner's own (fp32, 1e-5): the adapter really arrived.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl.engine.client import EngineClient, GenerateRequest
from asyncrl.engine.hf.launch import launch_hf_server
from asyncrl.learner.logprobs import token_logprobs
from asyncrl.weights.buckets import LORA_A, LORA_B
from asyncrl.weights.sync import WeightSender, WeightSyncError
from tests.test_lora_learner import _learner
from tests.test_torch_learner import _groups

PROMPT = [5, 6, 7, 8, 9]
TEMPERATURE = 0.7  # the learner's (tests.test_lora_learner._learner)


@pytest.fixture(scope="module")
def server(tiny_model):
    args = ["--num-threads", "1", "--group-timeout-s", "10"]
    handle = launch_hf_server(tiny_model, dtype="fp32", max_batch_size=4, extra_args=args)
    yield handle
    handle.stop()


async def _engine_logprobs(
    client: EngineClient, temperature: float = TEMPERATURE
) -> tuple[list[int], list[float], str]:
    params = {"max_new_tokens": 8, "temperature": temperature, "ignore_eos": True}
    out = await client.generate_one(GenerateRequest(PROMPT, params))
    return out.output_ids, out.output_logprobs, out.weight_version


def _learner_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    data = {
        "input_ids": torch.tensor([PROMPT + ids]),
        "attention_mask": torch.ones(1, len(PROMPT) + len(ids), dtype=torch.long),
        "response_mask": torch.ones(1, len(ids)),
        "position_ids": torch.arange(len(PROMPT) + len(ids))[None],
    }
    model.eval()
    with torch.no_grad():
        return token_logprobs(model, data, TEMPERATURE)[0][0].tolist()


def test_engine_logprobs_after_adapter_sync_equal_the_learners(server, tiny_model):
    learner = _learner(tiny_model)

    async def go():
        async with EngineClient(server.url, timeout=30) as client:
            sender = WeightSender(group_name="lora_test", timeout_s=10)
            await sender.init_group([client], backend="gloo")
            full = sum(t.numel() * 4 for _, t in learner.weights_for_sync())
            base_ids, base_logp, _ = await _engine_logprobs(client)
            for step in range(2):  # twice: the second lands on the pristine base, not the first
                for seed in range(3):
                    learner.step(_groups(seed=10 * step + seed))
                adapter = list(learner.adapter_for_sync())
                stats = await sender.sync(adapter, learner.version, bucket_bytes=2_000)
                assert stats.buckets > 1 and stats.bytes < full / 2  # the adapter alone
                ids, logp, version = await _engine_logprobs(client)
                assert version == str(learner.version)
                want = _learner_logprobs(learner.model, ids)
                assert logp == pytest.approx(want, abs=1e-5)
            # the adapter changed what the engine serves
            moved = _learner_logprobs(learner.model, base_ids)
            assert max(abs(a - b) for a, b in zip(moved, base_logp)) > 1e-3
            # merge mode: full weights with the adapter merged give the same policy
            await sender.sync(learner.weights_for_sync(), learner.version + 1)
            ids, logp, _ = await _engine_logprobs(client)
            assert logp == pytest.approx(_learner_logprobs(learner.model, ids), abs=1e-5)
            await sender.close()

    asyncio.run(go())


def test_a_bad_adapter_is_refused_and_the_model_kept(server, tiny_model):
    learner = _learner(tiny_model)
    learner.step(_groups())
    adapter = dict(learner.adapter_for_sync())
    name_a = next(n for n in adapter if n.endswith(LORA_A))
    name_b = name_a.removesuffix(LORA_A) + LORA_B

    async def go():
        async with EngineClient(server.url, timeout=30) as client:
            sender = WeightSender(group_name="lora_bad", timeout_s=10)
            await sender.init_group([client], backend="gloo")
            before = await _engine_logprobs(client, temperature=0)
            wrong_rank = [(name_a, adapter[name_a]), (name_b, adapter[name_b][:, :2])]
            bad = {
                "rank mismatch": wrong_rank,
                "names no linear layer": [("model.nope.lora_A.weight", adapter[name_a])],
                "shape mismatch": [(name_a, adapter[name_a].t().contiguous())],
            }
            for message, tensors in bad.items():
                with pytest.raises(WeightSyncError, match=message):
                    await sender.sync(tensors, version=99)
                await client.resume()  # a failed sync leaves the engine paused on purpose
            after = await _engine_logprobs(client, temperature=0)  # greedy: comparable
            assert after[0] == before[0] and after[1] == pytest.approx(before[1], abs=1e-6)
            await sender.close()

    asyncio.run(go())


def test_sglang_lora_adapter_calls_against_the_fake(tmp_path):
    """The client's native-LoRA calls (bodies checked by the fake against SGLang's structs; the
    same bodies against the wheel's own in tests/test_sglang_contract.py); a refusal is named."""
    from asyncrl.engine.client import EngineError
    from asyncrl.engine.versions import MAX_VERSION
    from asyncrl.weights.lora_native import write_adapter
    from tests.test_lora_native import _tensors, start_lora_fake
    from tests.test_sglang_versions import state

    handle = start_lora_fake(tmp_path, ".".join(map(str, MAX_VERSION)))
    write_adapter(_tensors(), tmp_path / "adapter")  # the fake reads what it loads

    async def go() -> None:
        async with EngineClient(handle.url) as client:
            await client.load_lora_adapter("policy_v1", str(tmp_path / "adapter"))
            assert state(handle.url)["adapters"] == {"policy_v1": str(tmp_path / "adapter")}
            with pytest.raises(EngineError, match="policy_v1 is already loaded"):
                await client.load_lora_adapter("policy_v1", str(tmp_path / "adapter"))
            await client.unload_lora_adapter("policy_v1")
            with pytest.raises(EngineError, match="not loaded"):
                await client.unload_lora_adapter("policy_v1")

    try:
        asyncio.run(go())
        assert state(handle.url)["violations"] == []
    finally:
        handle.stop()

"""What asyncrl's weight sync sends, loaded by SGLang 0.5.23's own Qwen2 model on the CPU.

The senders are real: the torch learner's `weights_for_sync` (full tensors; with LoRA merged),
the Megatron export's per-parameter path (`hf_megatron` rules, TP shards merged back and
converted to HF names: what `export_hf` yields, without the collectives) and the real
`WeightSender.sync`, whose group is the only fake (its broadcasts are recorded). Every bucket
then goes through SGLang's receive and `Qwen2ForCausalLM.load_weights`, legacy and v2 loaders,
on engine ranks of TP 1 and 2 (tests/fake_sglang/sglang_model.py). Every parameter of every
rank must be written and every sent tensor must land where SGLang serves it, value for value.
A tied model's `lm_head.weight` is not sent: SGLang serves the embedding as the head and drops
the copy (a warning per sync), hundreds of MB per sync on Qwen2.5 models.
"""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.learner import lora
from asyncrl.learner.megatron import name_mapping as hm
from asyncrl.learner.torch.learner import TorchLearner
from asyncrl.weights import sync as weight_sync
from asyncrl.weights.sync import WeightSender
from tests.fake_sglang.sglang_model import run_loader
from tests.fake_sglang.wheels import unpacked

VERSION = "0.5.23"
ENGINES = [{"tp": tp, "rank": rank, "loader": loader}
           for tp, rank in ((1, 0), (2, 0), (2, 1)) for loader in ("legacy", "v2")]  # fmt: skip
LORA = ["actor_train.model_args.lora_rank=4", "actor_train.model_args.lora_alpha=8"]


class Recorder:
    """The engine as `WeightSender` sees it: records each bucket's metadata."""

    url = "sglang-under-test"

    def __init__(self) -> None:
        self.buckets: list[dict] = []

    async def update_weights(self, names, dtypes, shapes, weight_version, load_format,
                             group_name, flush_cache, timeout_s) -> dict:  # fmt: skip
        self.buckets.append({"names": list(names), "dtypes": list(dtypes),
                             "shapes": [list(s) for s in shapes], "load_format": load_format})  # fmt: skip
        return {"success": True}

    async def prepare_update(self, pause_mode, timeout_s) -> None:
        pass

    async def finish_update(self, version, pause_mode) -> None:
        pass


def wire(named, load_format: str | None, monkeypatch) -> dict:
    """The real sender's buckets of `named`: metadata, and what each broadcast carries."""
    sent = [(n, t.detach().clone()) for n, t in named]
    payloads: list[list[torch.Tensor]] = []
    monkeypatch.setattr(weight_sync, "broadcast",
                        lambda tensors, group, src=0: payloads.append([t.clone() for t in tensors]))  # fmt: skip
    sender, engine = WeightSender(), Recorder()
    sender._group, sender.engines = object(), [engine]  # the process group: the faked edge
    # small buckets: q/k/v and gate/up halves of one SGLang parameter arrive in different ones
    asyncio.run(sender.sync(iter(sent), 1, bucket_bytes=6000, load_format=load_format,
                            pause_mode=None))  # fmt: skip
    assert len(payloads) == len(engine.buckets) > 2
    return {"sent": sent, "buckets": engine.buckets, "payloads": payloads}


def learner(model_dir, *overrides: str) -> TorchLearner:
    cfg = load_config(None, list(overrides))
    return TorchLearner(model_dir, cfg.actor_train, cfg.actor, cfg.algorithm, temperature=0.7,
                        total_steps=10, reference=cfg.reference)  # fmt: skip


def megatron_export(model: torch.nn.Module, tp: int):
    """The Megatron learner's export of `model`'s weights held over `tp` ranks: per rule the
    ranks' shards (as `load_hf_into` cuts them), merged as `export_hf` gathers them, in HF
    names (`to_hf`)."""
    shape = hm.ModelShape.from_hf_config(model.config.to_dict()).padded_to(tp)
    for rule, full in hm.hf_to_megatron(model.state_dict(), shape):
        merged = hm.tp_merge(rule, hm.tp_split(rule, full, tp, shape), shape)
        yield from hm.to_hf(rule, merged, shape)


@pytest.fixture(scope="module")
def untied_model(tiny_model, tmp_path_factory):
    """The tiny model with a head of its own (bf16, as an engine would serve it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.2)  # differs from the embedding
    path = tmp_path_factory.mktemp("untied")
    model.to(torch.bfloat16).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    return path


def sources(tiny_model, untied_model) -> dict:
    """(what a sender sends, its load_format) per source; see the module docstring."""
    from transformers import AutoModelForCausalLM

    tied = learner(tiny_model)
    untied = learner(untied_model, "actor_train.model_args.dtype=bf16")
    peft = learner(tiny_model, *LORA)
    with torch.no_grad():  # a trained adapter: the merged weights differ from the base
        for _, layer in lora.lora_layers(peft.model):
            layer.lora_B[lora.ADAPTER].weight.normal_(0, 0.5)
    hf_tied = AutoModelForCausalLM.from_pretrained(tiny_model)
    hf_untied = AutoModelForCausalLM.from_pretrained(untied_model)
    return {
        "torch-tied": (tied.weights_for_sync(), "flattened_bucket", tied.model.config),
        "torch-untied-bf16": (untied.weights_for_sync(), None, untied.model.config),
        "lora-merged-tied": (peft.weights_for_sync(), "auto", hf_tied.config),
        "megatron-tied-tp2": (megatron_export(hf_tied, 2), "flattened_bucket", hf_tied.config),
        "megatron-untied": (megatron_export(hf_untied, 1), None, hf_untied.config),
        # asyncrl before the fix (the full state dict): shows the check sees a dropped tensor
        "control-tied-with-head": (hf_tied.state_dict().items(), "flattened_bucket",
                                   hf_tied.config),
    }  # fmt: skip


def qwen2_config(config) -> dict:
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
            "rms_norm_eps", "tie_word_embeddings", "hidden_act")  # fmt: skip
    return {k: getattr(config, k) for k in keys}


@pytest.fixture(scope="module")
def loaded(tiny_model, untied_model, tmp_path_factory) -> tuple[dict, dict]:
    """(what each source sent, SGLang's load of it per engine rank)."""
    from safetensors.torch import save_file

    src = unpacked(VERSION)
    request = tmp_path_factory.mktemp("sglang-load")
    tensors, manifest, sent = {}, [], {}
    with pytest.MonkeyPatch.context() as mp:
        for key, (named, fmt, config) in sources(tiny_model, untied_model).items():
            w = wire(named, fmt, mp)
            sent[key] = w["sent"]
            dtypes = {t.dtype for _, t in w["sent"]}
            assert len(dtypes) == 1, dtypes
            for i, (_, t) in enumerate(w["sent"]):
                tensors[f"{key}/sent/{i}"] = t.contiguous()
            for j, payload in enumerate(w["payloads"]):  # one flat buffer, or per tensor
                for i, t in enumerate(payload):
                    tensors[f"{key}/bucket/{j}/{i}"] = t.contiguous()
            manifest.append({"key": key, "config": qwen2_config(config),
                             "dtype": str(dtypes.pop()).removeprefix("torch."),
                             "sent": [n for n, _ in w["sent"]], "buckets": w["buckets"]})  # fmt: skip
    save_file(tensors, request / "tensors.safetensors")
    (request / "manifest.json").write_text(json.dumps({"sources": manifest, "engines": ENGINES}))
    return sent, run_loader(src, request)


REAL = ["torch-tied", "torch-untied-bf16", "lora-merged-tied", "megatron-tied-tp2",
        "megatron-untied"]  # fmt: skip


@pytest.mark.parametrize("source", REAL)
def test_sglang_loads_every_parameter_from_what_asyncrl_sends(loaded, source):
    sent, result = loaded
    for engine in ENGINES:
        label = f"{source}|tp{engine['tp']}r{engine['rank']}|{engine['loader']}"
        got = result[label]
        assert got["error"] is None, f"{label}: SGLang refused the sync: {got['error']}"
        assert got["unwritten"] == [], f"{label}: parameters never written"
        assert got["not_landed"] == {}, f"{label}: sent tensors not served"
        assert got["warnings"] == [], f"{label}: SGLang warned"
    names = [n for n, _ in sent[source]]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("source", ["torch-tied", "lora-merged-tied", "megatron-tied-tp2"])
def test_a_tied_model_never_sends_its_head(loaded, source):
    sent, _ = loaded
    names = {n for n, _ in sent[source]}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


def test_the_check_sees_what_sglang_drops(loaded):
    """The old send (the full state dict of a tied model): SGLang skips lm_head.weight."""
    _, result = loaded
    for engine in ENGINES:
        label = f"control-tied-with-head|tp{engine['tp']}r{engine['rank']}|{engine['loader']}"
        got = result[label]
        assert got["error"] is None and got["unwritten"] == []
        assert got["not_landed"] == {"lm_head.weight": "no parameter takes it"}, label
        if engine["loader"] == "legacy":  # 0.5.23's warning, once per sync and engine
            assert got["warnings"] == ["Parameter lm_head.weight not found in params_dict"]


def test_untied_head_is_sent_and_differs_from_the_embedding(loaded):
    sent, _ = loaded
    named = dict(sent["torch-untied-bf16"])
    assert not torch.equal(named["lm_head.weight"], named["model.embed_tokens.weight"])
    assert copy.copy(named["lm_head.weight"]).dtype == torch.bfloat16


def test_the_hf_engine_serves_the_synced_embedding_as_its_tied_head(tiny_model):
    """The hf engine without the head sent: its head is the embedding's parameter, so the
    policy it serves after the sync is the learner's, head included."""
    from asyncrl.engine.client import EngineClient
    from asyncrl.engine.hf.launch import launch_hf_server
    from tests.test_lora_sync import _engine_logprobs, _learner_logprobs

    tied = learner(tiny_model)
    embedding = tied.model.model.embed_tokens.weight
    assert tied.model.lm_head.weight is embedding
    with torch.no_grad():
        embedding.add_(torch.randn_like(embedding), alpha=0.5)  # head and input move together
    handle = launch_hf_server(tiny_model, dtype="fp32", max_batch_size=4,
                              extra_args=["--num-threads", "1", "--group-timeout-s", "10"])  # fmt: skip

    async def go() -> None:
        async with EngineClient(handle.url, timeout=30) as client:
            sender = WeightSender(group_name="tied_head", timeout_s=10)
            await sender.init_group([client], backend="gloo")
            assert "lm_head.weight" not in {n for n, _ in tied.weights_for_sync()}
            ids, logp, _ = await _engine_logprobs(client)  # before: the learner's model differs
            want = _learner_logprobs(tied.model, ids)
            assert max(abs(a - b) for a, b in zip(logp, want)) > 1e-2
            stats = await sender.sync(tied.weights_for_sync(), 1, bucket_bytes=6000)
            assert stats.buckets > 1
            ids, logp, version = await _engine_logprobs(client)
            assert version == "1"
            assert logp == pytest.approx(_learner_logprobs(tied.model, ids), abs=1e-5)
            await sender.close()

    try:
        asyncio.run(go())
    finally:
        handle.stop()

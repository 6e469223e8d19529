"""HF <-> Megatron mapping on a tiny Qwen2 (and Llama/Qwen3 configs): names, shapes, exact
round trips, TP shards, and Megatron's own split procedure reproduced on the shards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncrl.learner.megatron import name_mapping as hm

CFG = dict(
    model_type="qwen2",
    vocab_size=61,  # odd on purpose: padding to the TP multiple is exercised
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=48,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def tiny():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = {k: v for k, v in CFG.items() if k != "model_type"}
    model = Qwen2ForCausalLM(Qwen2Config(**cfg)).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return model


def shape(tp: int = 1) -> hm.ModelShape:
    return hm.ModelShape.from_hf_config(CFG).padded_to(tp)


def qkv_rule() -> hm.Rule:
    return next(r for r in hm.rules(shape()) if r.mcore.endswith("linear_qkv.weight"))


def test_names_and_shapes_for_tiny_qwen2(tiny):
    s = shape(4)
    assert (s.num_kv_heads, s.head_dim, s.vocab_rows, s.qkv_bias) == (2, 4, 64, True)
    got = dict(hm.hf_to_megatron(tiny.state_dict(), s))
    names = {r.mcore: tuple(t.shape) for r, t in got.items()}
    assert names["embedding.word_embeddings.weight"] == (64, 32)
    assert names["output_layer.weight"] == (64, 32)
    assert names["decoder.layers.1.self_attention.linear_qkv.weight"] == ((8 + 4) * 4, 32)
    assert names["decoder.layers.1.self_attention.linear_qkv.bias"] == (48,)
    assert names["decoder.layers.0.self_attention.linear_proj.weight"] == (32, 32)
    assert names["decoder.layers.0.mlp.linear_fc1.weight"] == (96, 32)
    assert names["decoder.layers.0.mlp.linear_fc2.weight"] == (32, 48)
    assert names["decoder.layers.0.input_layernorm.weight"] == (32,)
    assert names["decoder.layers.0.pre_mlp_layernorm.weight"] == (32,)
    assert names["decoder.final_layernorm.weight"] == (32,)
    assert len(names) == 1 + 2 * 7 + 2
    # every HF tensor is used exactly once
    used = [n for r in got for n in r.hf]
    assert sorted(used) == sorted(tiny.state_dict())
    te = {r.mcore for r in hm.rules(s, te_layernorm=True)}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te


def test_round_trip_hf_megatron_hf_is_exact(tiny):
    s = shape(4)
    hf = tiny.state_dict()
    mcore = {r.mcore: t for r, t in hm.hf_to_megatron(hf, s)}
    back = list(hm.megatron_to_hf(mcore, s))
    assert [n for n, _ in back] == [n for r in hm.rules(s) for n in r.hf]
    for name, tensor in back:
        assert tensor.dtype == hf[name].dtype and torch.equal(tensor, hf[name]), name
    assert torch.equal(mcore["embedding.word_embeddings.weight"][61:], torch.zeros(3, 32))


@pytest.mark.parametrize("tp", [1, 2])
def test_tp_split_merge_round_trip(tiny, tp):
    s = shape(tp)
    for rule, full in hm.hf_to_megatron(tiny.state_dict(), s):
        shards = hm.tp_split(rule, full, tp, s)
        assert len(shards) == tp
        if rule.tp != "none":
            assert all(x.numel() * tp == full.numel() for x in shards)
        assert torch.equal(hm.tp_merge(rule, shards, s), full), rule.mcore


def test_tp_size_must_divide_heads():
    with pytest.raises(hm.MappingError, match="tensor_model_parallel_size 4"):
        rule = qkv_rule()
        hm.tp_split(rule, torch.zeros(rule.shape), 4, shape())


@pytest.mark.parametrize("tp", [1, 2])
def test_shards_compute_what_hf_computes(tiny, tp):
    """Reproduce Megatron's per-rank use of each shard and compare with the HF modules."""
    s = shape(tp)
    mc = {r.mcore: (r, t) for r, t in hm.hf_to_megatron(tiny.state_dict(), s)}
    layer = tiny.model.layers[0]
    x = torch.randn(5, 32)

    def shards(name):
        rule, full = mc[f"decoder.layers.0.{name}"]
        return hm.tp_split(rule, full, tp, s)

    with torch.no_grad():
        qs, ks, vs = [], [], []
        for w, b in zip(shards("self_attention.linear_qkv.weight"),
                        shards("self_attention.linear_qkv.bias")):  # fmt: skip
            mixed = (x @ w.T + b).view(5, s.num_kv_heads // tp, -1)  # [s, ng/tp, (np/ng+2)hn]
            per = s.num_heads // s.num_kv_heads * s.head_dim
            q, k, v = torch.split(mixed, [per, s.head_dim, s.head_dim], dim=-1)
            qs.append(q.reshape(5, -1)), ks.append(k.reshape(5, -1)), vs.append(v.reshape(5, -1))
        attn = layer.self_attn
        assert torch.allclose(torch.cat(qs, -1), attn.q_proj(x), atol=1e-6)
        assert torch.allclose(torch.cat(ks, -1), attn.k_proj(x), atol=1e-6)
        assert torch.allclose(torch.cat(vs, -1), attn.v_proj(x), atol=1e-6)
        heads = torch.randn(5, s.num_heads * s.head_dim)
        parts = torch.chunk(heads, tp, dim=-1)
        row = sum(p @ w.T for p, w in zip(parts, shards("self_attention.linear_proj.weight")))
        assert torch.allclose(row, attn.o_proj(heads), atol=1e-5)
        mlp = 0
        for w1, w2 in zip(shards("mlp.linear_fc1.weight"), shards("mlp.linear_fc2.weight")):
            gate, up = torch.chunk(x @ w1.T, 2, dim=-1)  # Megatron's glu on the local shard
            mlp = mlp + (F.silu(gate) * up) @ w2.T
        assert torch.allclose(mlp, layer.mlp(x), atol=1e-5)


def test_pipeline_layer_offsets():
    name = "decoder.layers.3.mlp.linear_fc1.weight"
    assert hm.layer_index(name) == 3
    assert hm.with_layer_offset(name, 10) == "decoder.layers.13.mlp.linear_fc1.weight"
    assert hm.with_layer_offset("output_layer.weight", 10) == "output_layer.weight"


def test_config_variants_and_refusals():
    llama = hm.ModelShape.from_hf_config({**CFG, "model_type": "llama"})
    assert not llama.qkv_bias and not llama.qk_norm
    qwen3 = hm.ModelShape.from_hf_config({**CFG, "model_type": "qwen3", "head_dim": 16})
    assert qwen3.qk_norm and qwen3.head_dim == 16 and qwen3.qkv_rows == (8 + 4) * 16
    names = {r.mcore for r in hm.rules(qwen3)}
    assert "decoder.layers.1.self_attention.q_layernorm.weight" in names
    tied = hm.ModelShape.from_hf_config({**CFG, "tie_word_embeddings": True})
    assert "output_layer.weight" not in {r.mcore for r in hm.rules(tied)}
    with pytest.raises(hm.MappingError, match="Megatron-Bridge"):
        hm.ModelShape.from_hf_config({**CFG, "model_type": "gpt2"})
    with pytest.raises(hm.MappingError, match="mixture-of-experts"):
        hm.ModelShape.from_hf_config({**CFG, "num_experts": 8})
    bad = qkv_rule()
    with pytest.raises(hm.MappingError, match="KV heads"):
        hm.to_megatron(bad, [torch.zeros(32, 32), torch.zeros(4, 32), torch.zeros(8, 32)], shape())
    with pytest.raises(hm.MappingError, match="linear_qkv.weight: HF tensors give"):
        hm.to_megatron(bad, [torch.zeros(32, 16), torch.zeros(8, 16), torch.zeros(8, 16)], shape())


def test_checkpoint_reader_and_writer_round_trip(tmp_path, tiny):
    """The lazy safetensors reader the Megatron loader uses, and the HF writer of
    save_pretrained: tensors come back bit-exact, with an index and the config files."""
    from asyncrl.learner.megatron.weights import HFCheckpoint, save_hf

    tiny.save_pretrained(tmp_path / "src")
    ckpt = HFCheckpoint(tmp_path / "src")
    state = tiny.state_dict()
    s = shape(2)
    mcore = dict(hm.hf_to_megatron(ckpt, s))  # lazy per-tensor reads, no full load
    assert len(mcore) == len(hm.rules(s))
    with pytest.raises(hm.MappingError, match="no tensor 'nope'"):
        ckpt("nope")
    save_hf(iter(state.items()), tmp_path / "src", tmp_path / "out")
    back = HFCheckpoint(tmp_path / "out")
    assert (tmp_path / "out" / "config.json").exists()
    for name, tensor in state.items():
        assert torch.equal(back(name), tensor), name


def test_every_parameter_has_one_owning_chunk_under_virtual_pipeline_stages():
    """PP=2, VPP=2 over 4 layers: rank r chunk v holds layer v·2 + r (Megatron's interleaved
    layout); the embedding lives in the first chunk of rank 0, the norm and head in the last
    chunk of the last rank, and the local names are the chunk's own (layer 0)."""
    from asyncrl.learner.megatron.weights import _local_name, owner_chunk

    shape = hm.ModelShape.from_hf_config({**CFG, "num_hidden_layers": 4})
    layout = [[(0, 1), (2, 1)], [(1, 1), (3, 1)]]  # [pipeline rank][chunk] = (first, count)
    owners = {r.mcore: owner_chunk(r, layout) for r in hm.rules(shape)}
    assert owners["embedding.word_embeddings.weight"] == (0, 0)
    assert owners["decoder.final_layernorm.weight"] == owners["output_layer.weight"] == (1, 1)
    for layer, want in enumerate([(0, 0), (1, 0), (0, 1), (1, 1)]):
        assert owners[f"decoder.layers.{layer}.mlp.linear_fc2.weight"] == want
    rule = next(r for r in hm.rules(shape) if r.mcore.startswith("decoder.layers.3.mlp.linear_fc2"))
    assert _local_name(rule, layout[1][1][0]) == "decoder.layers.0.mlp.linear_fc2.weight"

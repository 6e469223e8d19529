"""Qwen3-MoE in the Megatron learner without running Megatron: the HF <-> Megatron mapping of
the router and every expert (exact round trip, expert-parallel local names, expert-tensor
shards), TransformerConfig's MoE fields, and the expert-parallel settings `config validate`
refuses. The learner itself runs in tests/test_megatron_moe_emulation.py."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.config.strategy_keys import expert_problem
from asyncrl.learner.megatron import name_mapping as hm
from asyncrl.learner.megatron.args import moe_kwargs

MOE = dict(
    model_type="qwen3_moe", vocab_size=50, hidden_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=4, intermediate_size=24,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=True,
)  # fmt: skip


def hf_tensors(s: hm.ModelShape) -> dict[str, torch.Tensor]:
    """Random HF tensors of every name the rules read, shaped by the Megatron rule."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for rule, _ in ((r, None) for r in hm.rules(s)):
        full = torch.randn(rule.shape, generator=gen)
        out.update(dict(hm.to_hf(rule, full, s)))
    return out


def test_the_router_and_every_expert_map_both_ways_exactly():
    s = hm.ModelShape.from_hf_config(MOE)
    assert s.moe_layers == (0, 2) and s.num_experts == 4 and s.qk_norm
    names = {r.mcore: r for r in hm.rules(s)}
    router = names["decoder.layers.0.mlp.router.weight"]
    assert router.hf == ("model.layers.0.mlp.gate.weight",) and router.shape == (4, 16)
    fc1 = names["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.hf == ("model.layers.2.mlp.experts.3.gate_proj.weight",
                      "model.layers.2.mlp.experts.3.up_proj.weight")  # fmt: skip
    assert fc1.expert == 3 and fc1.shape == (16, 16)
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names  # mlp_only_layers stays dense
    assert "decoder.layers.1.mlp.router.weight" not in names
    hf = hf_tensors(s)
    assert "model.layers.0.mlp.experts.2.down_proj.weight" in hf
    back = dict(hm.megatron_to_hf(dict((r.mcore, t) for r, t in hm.hf_to_megatron(hf, s)), s))
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[n], t) for n, t in hf.items())


def test_expert_parallel_local_names_and_expert_tensor_shards():
    name = "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"
    assert hm.expert_local_name(name, 2) == (
        "decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"
    )
    s = hm.ModelShape.from_hf_config(MOE)
    rule = next(r for r in hm.rules(s) if r.mcore.endswith("local_experts.1.linear_fc1.weight"))
    full = torch.randn(rule.shape)
    shards = hm.tp_split(rule, full, 2, s)  # [gate_r; up_r] per expert-tensor rank
    assert shards[0].shape == (8, 16)
    assert torch.equal(hm.tp_merge(rule, shards, s), full)
    with pytest.raises(hm.MappingError, match="expert_tensor_parallel_size 3"):
        hm.tp_split(rule, full, 3, s)


def test_other_moe_types_and_shared_experts_need_the_bridge():
    with pytest.raises(hm.MappingError, match="install Megatron-Bridge"):
        hm.ModelShape.from_hf_config({**MOE, "model_type": "qwen2_moe"})
    with pytest.raises(hm.MappingError, match="'qwen3' needs Megatron-Bridge"):
        hm.ModelShape.from_hf_config({**MOE, "model_type": "qwen3"})
    with pytest.raises(hm.MappingError, match="shared experts"):
        hm.ModelShape.from_hf_config({**MOE, "shared_expert_intermediate_size": 8})


def test_the_router_is_configured_as_qwen3_moe_routes():
    kw = moe_kwargs(MOE)
    assert kw["num_moe_experts"] == 4 and kw["moe_router_topk"] == 2
    assert kw["moe_ffn_hidden_size"] == 8 and kw["moe_layer_freq"] == [1, 0, 1]
    # softmax over the top-k logits == softmax over all, top-k, renormalised (norm_topk_prob)
    assert kw["moe_router_pre_softmax"] is False
    assert moe_kwargs({**MOE, "norm_topk_prob": False})["moe_router_pre_softmax"] is True
    assert kw["moe_router_load_balancing_type"] == "none" and kw["moe_aux_loss_coeff"] == 0
    assert kw["moe_grouped_gemm"] is False and kw["moe_expert_capacity_factor"] is None
    assert moe_kwargs({**MOE, "num_experts": 0}) == {}


@pytest.mark.parametrize(
    "hf,sc,world,problem",
    [
        (MOE, {"expert_model_parallel_size": 2}, 2, None),
        (MOE, {"expert_model_parallel_size": 4}, 4, None),
        (MOE, {"expert_model_parallel_size": 3}, 3, "must divide the model's 4 experts"),
        (MOE, {"expert_model_parallel_size": 4}, 2, "not a multiple"),
        (MOE, {"expert_tensor_parallel_size": 2}, 2, "only the TP size"),
        (MOE, {"tensor_model_parallel_size": 2}, 2, "needs sequence_parallel"),
        (MOE, {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}, 4,
         "use_bridge: true"),
        (MOE, {"moe_grouped_gemm": True}, 1, "needs use_bridge: true"),
        ({"model_type": "qwen2"}, {"expert_model_parallel_size": 2}, 2, "is dense"),
        ({"model_type": "qwen2"}, {"expert_tensor_parallel_size": 2}, 2, "is dense"),
    ],
)  # fmt: skip
def test_expert_parallel_sizes_are_checked_against_the_model(hf, sc, world, problem):
    got = expert_problem(hf, sc, world)
    if problem is None:
        assert got is None
    else:
        assert got and problem in got, got


MEG = ["actor_train.strategy_args.strategy_name=megatron_train",
       "actor_train.model_args.disable_gradient_checkpointing=true"]  # fmt: skip


def test_config_validate_takes_expert_parallel_on_the_embedded_moe():
    cfg = load_config(None, [*MEG, "actor_train.model_args.embedded_arch=moe",
                             "actor_train.device_mapping=[0,1]",
                             "actor_train.strategy_args.strategy_config.expert_model_parallel_size=2"])  # fmt: skip
    assert cfg.actor_train.strategy_args.strategy_config["expert_model_parallel_size"] == 2


@pytest.mark.parametrize(
    "extra,problem",
    [
        (["actor_train.model_args.embedded_arch=moe", "actor_train.device_mapping=[0,1,2]",
          "actor_train.strategy_args.strategy_config.expert_model_parallel_size=3"],
         "must divide the model's 8 experts"),
        (["actor_train.device_mapping=[0,1]",
          "actor_train.strategy_args.strategy_config.expert_model_parallel_size=2"], "is dense"),
        (["actor_train.model_args.embedded_arch=moe", "actor.router_replay=r3",
          "actor_train.device_mapping=[0,1]", "actor_train.strategy_args.strategy_config."
          "sequence_parallel=true"], "r3 with sequence_parallel"),
        (["actor_train.model_args.embedded_arch=moe", "actor.router_replay=r3",
          "actor_train.strategy_args.strategy_config.recompute_granularity=full"],
         "recompute"),
    ],
)  # fmt: skip
def test_config_validate_refuses_what_the_megatron_moe_path_cannot_run(extra, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(None, [*MEG, *extra])


def test_r3_with_megatron_train_is_accepted_on_the_embedded_moe():
    cfg = load_config(None, [*MEG, "actor_train.model_args.embedded_arch=moe",
                             "actor.router_replay=r3", "actor_train.device_mapping=[0,1]",
                             "actor_train.strategy_args.strategy_config.expert_model_parallel_size=2"])  # fmt: skip
    assert cfg.actor.router_replay == "r3"


QWEN3_30B_A3B = dict(  # Qwen/Qwen3-30B-A3B's config.json, the fields the learner reads
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, rope_theta=1000000.0,
    max_position_embeddings=40960, rms_norm_eps=1e-6,
)  # fmt: skip


def test_the_moe_recipe_is_a_megatron_plan_with_expert_parallelism():
    from pathlib import Path

    from asyncrl.learner.megatron import args as ma

    recipe = Path(__file__).resolve().parent.parent / "configs"
    cfg = load_config(recipe / "qwen3-30b-a3b-math-sglang-megatron.yaml")
    train = cfg.actor_train
    sc = train.strategy_args.strategy_config
    assert expert_problem(QWEN3_30B_A3B, sc, len(train.device_mapping)) is None
    p = ma.plan(train, cfg.actor.optim, QWEN3_30B_A3B, padded_vocab=151936)
    assert p.parallel["expert_model_parallel_size"] == 4
    t = p.transformer
    assert (t["num_moe_experts"], t["moe_router_topk"], t["moe_ffn_hidden_size"]) == (128, 8, 768)
    assert t["qk_layernorm"] and t["moe_layer_freq"] == 1 and not t["moe_router_pre_softmax"]
    assert cfg.actor.router_replay == "off"  # SGLang's routed experts are not read yet
    s = hm.ModelShape.from_hf_config(QWEN3_30B_A3B)
    # embedding, final norm, head; per layer: 2 norms, qkv, q/k norms, proj, router, experts
    assert len(hm.rules(s)) == 3 + 48 * (2 + 1 + 2 + 1 + 1 + 2 * 128)


def test_r3_with_megatron_train_reads_megatrons_recompute_not_the_torch_switch(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    cfg = load_config(None, ["actor_train.strategy_args.strategy_name=megatron_train",
                             f"actor_train.model_args.model_name_or_path={tmp_path}",
                             "actor.router_replay=r3", "actor_train.device_mapping=[0,1]",
                             "actor_train.strategy_args.strategy_config.expert_model_parallel_size=2"])  # fmt: skip
    assert cfg.actor_train.model_args.actor_checkpointing()  # fsdp2_train's switch: not read
    with pytest.raises(ConfigError, match="must divide the model's 128 experts"):
        load_config(None, ["actor_train.strategy_args.strategy_name=megatron_train",
                           f"actor_train.model_args.model_name_or_path={tmp_path}",
                           "actor_train.device_mapping=[0,1,2]",
                           "actor_train.strategy_args.strategy_config.expert_model_parallel_size=3"])  # fmt: skip

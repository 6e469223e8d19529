"""Config -> Megatron-core arguments, and the Megatron learner's batch layout and
vocab-parallel entropy math, all on the CPU (Megatron itself is exercised in tests/gpu/)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from asyncrl.algo.kl import entropy_from_logits
from asyncrl.config import load_config
from asyncrl.learner.collate import collate
from asyncrl.learner.logprobs import token_logprobs
from asyncrl.learner.megatron import args as ma
from asyncrl.learner.megatron import batch as mb
from asyncrl.types import TrajectoryGroup

HF = {
    "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 3584, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02,
}  # fmt: skip


def train_cfg(**strategy_config):
    cfg = load_config(None, ["actor_train.strategy_args.strategy_name=megatron_train",
                             "actor_train.model_args.dtype=bf16",
                             "actor_train.training_args.learning_rate=2e-6",
                             "actor_train.training_args.max_grad_norm=1.0"])  # fmt: skip
    cfg.actor_train.strategy_args.strategy_config = dict(strategy_config)
    return cfg


def test_plan_passes_every_knob_through():
    cfg = train_cfg(
        tensor_model_parallel_size=4, pipeline_model_parallel_size=2, context_parallel_size=1,
        expert_model_parallel_size=1, sequence_parallel=True, use_distributed_optimizer=True,
        overlap_grad_reduce=True, recompute_granularity="full", recompute_method="uniform",
        recompute_num_layers=1, transformer_impl="transformer_engine",
        override_transformer_config={"use_flash_attn": True, "apply_rope_fusion": True},
    )  # fmt: skip
    p = ma.plan(cfg.actor_train, cfg.actor.optim, HF, padded_vocab=151936)
    assert p.parallel == {
        "tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 2,
        "context_parallel_size": 1, "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": None, "virtual_pipeline_model_parallel_size": None,
    }  # fmt: skip
    t = p.transformer
    assert (t["num_layers"], t["hidden_size"], t["num_attention_heads"]) == (28, 3584, 28)
    assert (t["num_query_groups"], t["ffn_hidden_size"], t["kv_channels"]) == (4, 18944, 128)
    assert t["normalization"] == "RMSNorm" and t["gated_linear_unit"] and t["add_qkv_bias"]
    assert t["activation_func"] == "silu" and not t["add_bias_linear"]
    assert t["hidden_dropout"] == t["attention_dropout"] == 0.0
    assert t["bf16"] and t["params_dtype"] == "bfloat16"
    assert t["tensor_model_parallel_size"] == 4 and t["pipeline_model_parallel_size"] == 2
    assert t["sequence_parallel"] and t["recompute_granularity"] == "full"
    assert (t["recompute_method"], t["recompute_num_layers"]) == ("uniform", 1)
    assert t["use_flash_attn"] and t["apply_rope_fusion"]  # override applied last
    assert p.model == {
        "vocab_size": 151936, "max_sequence_length": 32768, "position_embedding_type": "rope",
        "rotary_percent": 1.0, "rotary_base": 1000000,
        "share_embeddings_and_output_weights": False, "parallel_output": True,
    }  # fmt: skip
    assert p.ddp["use_distributed_optimizer"] and p.ddp["overlap_grad_reduce"]
    o = p.optimizer
    assert (o["optimizer"], o["lr"], o["clip_grad"], o["bf16"]) == ("adam", 2e-6, 1.0, True)
    assert o["use_distributed_optimizer"] and (o["adam_beta1"], o["adam_beta2"]) == (0.9, 0.999)
    assert p.transformer_impl == "transformer_engine" and p.use_bridge == "auto"


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"tensor_parallel": 2}, "strategy_config.tensor_parallel is not a Megatron option"),
        ({"tensor_model_parallel_size": 0}, "must be a positive int"),
        ({"recompute_granularity": "some"}, "'some' is not one of full, selective"),
        ({"recompute_method": "uniform"}, "needs recompute_num_layers"),
        ({"virtual_pipeline_model_parallel_size": 2}, "needs pipeline_model_parallel_size >= 2"),
        ({"context_parallel_size": 0}, "context_parallel_size must be a positive int"),
        ({"pipeline_model_parallel_size": 3}, "28 layers do not split into .* stages \\(3\\)"),
        (
            {"pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 2},
            "28 layers do not split into .* stages \\(8\\)",
        ),
        ({"transformer_impl": "apex"}, "transformer_impl: 'apex'"),
    ],
)
def test_bad_megatron_options_are_named(config, fragment):
    cfg = train_cfg(**config)
    with pytest.raises(ma.MegatronConfigError, match=fragment):
        ma.plan(cfg.actor_train, cfg.actor.optim, HF, 151936)


def test_virtual_pipeline_and_context_parallel_pass_through():
    """VPP runs Megatron's interleaved schedule the way Megatron's training loop does (separate
    isend/irecv: with PP=2 a batch of both directions could pair messages wrongly); VPP 1 is
    no VPP; CP reaches initialize_model_parallel and TransformerConfig."""
    cfg = train_cfg(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                    context_parallel_size=2)  # fmt: skip
    p = ma.plan(cfg.actor_train, cfg.actor.optim, HF, padded_vocab=151936)
    assert p.parallel["virtual_pipeline_model_parallel_size"] == 2
    assert p.parallel["context_parallel_size"] == p.transformer["context_parallel_size"] == 2
    assert p.transformer["overlap_p2p_comm"] and not p.transformer["batch_p2p_comm"]
    one = train_cfg(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=1)
    p = ma.plan(one.actor_train, one.actor.optim, HF, padded_vocab=151936)
    assert p.parallel["virtual_pipeline_model_parallel_size"] is None
    assert "overlap_p2p_comm" not in p.transformer


def test_model_features_outside_the_builtin_path_are_refused():
    with pytest.raises(ma.MegatronConfigError, match="rope_scaling"):
        ma.model_kwargs({**HF, "rope_scaling": {"type": "llama3"}}, 10)
    with pytest.raises(ma.MegatronConfigError, match="rope_scaling"):
        ma.model_kwargs({**HF, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, 10)
    nested = {k: v for k, v in HF.items() if k != "rope_theta"}
    nested["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    assert ma.model_kwargs(nested, 10)["rotary_base"] == 500000
    with pytest.raises(ma.MegatronConfigError, match="sliding-window"):
        ma.model_kwargs({**HF, "use_sliding_window": True}, 10)


MEG = "actor_train.strategy_args.strategy_name=megatron_train"


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["actor_train.strategy_args.strategy_config={context_parallel_size: 2}"],
         "context_parallel_size: 2 is a Megatron parallel size; fsdp2_train has no such"),
        (["actor_train.strategy_args.strategy_config={virtual_pipeline_model_parallel_size: 2}"],
         "virtual_pipeline_model_parallel_size: 2 is a Megatron parallel size"),
        ([MEG, "actor_train.strategy_args.strategy_config={context_parallel_size: 2}"],
         "has 1 device\\(s\\), not a multiple of .* \\(1 x 1 x 2\\)"),
        ([MEG, "actor_train.device_mapping=[0,1]",
          "actor_train.strategy_args.strategy_config={virtual_pipeline_model_parallel_size: 2}"],
         "virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size >= 2"),
        ([MEG, "actor_train.strategy_args.strategy_config={context_parallel_size: 1.5}"],
         "context_parallel_size must be a positive int, got 1.5"),
    ],
)  # fmt: skip
def test_parallel_sizes_a_run_cannot_honour_are_refused_at_validation(overrides, fragment):
    from asyncrl.config import ConfigError

    with pytest.raises(ConfigError, match=fragment):
        load_config(None, overrides)


def test_context_parallel_and_virtual_pipeline_validate_where_they_run():
    sc = "actor_train.strategy_args.strategy_config="
    cfg = load_config(None, [MEG, "actor_train.device_mapping=[0,1,2,3]",
                             sc + "{context_parallel_size: 2, pipeline_model_parallel_size: 2, "
                             "virtual_pipeline_model_parallel_size: 2}"])  # fmt: skip
    assert cfg.actor_train.strategy_args.strategy_config["context_parallel_size"] == 2


def test_megatron_modules_import_without_megatron():
    code = (
        "import sys\n"
        "import asyncrl.learner.megatron.learner, asyncrl.learner.megatron.worker\n"
        "import asyncrl.learner.megatron.build, asyncrl.learner.megatron.weights\n"
        "import asyncrl.learner.megatron.context, asyncrl.learner.megatron.logits\n"
        "import asyncrl.learner.megatron.head\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'megatron']\n"
        "sys.modules['megatron'] = None  # as if megatron-core were not installed\n"
        "from asyncrl.learner.megatron.learner import require_megatron\n"
        "try:\n    require_megatron()\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR the megatron_train strategy needs megatron-core" in out.stdout, out.stderr


# ---- batch layout ------------------------------------------------------------------------------
def groups(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(3):
        responses = [
            {"response_ids": rng.integers(5, 60, int(rng.integers(1, 7))), "reward": 1.0,
             "finish_reason": "stop"}
            for _ in range(2)
        ]  # fmt: skip
        for r in responses:
            r["rollout_logprobs"] = -np.ones(len(r["response_ids"]))
            r["versions"] = np.zeros(len(r["response_ids"]))
        out.append(
            TrajectoryGroup.from_responses(f"g{g}", rng.integers(5, 60, 2 + 2 * g), responses)
        )
    return out


def test_right_aligned_rows_give_the_same_logprobs_without_a_mask():
    from helpers import random_qwen2

    model = random_qwen2(init_std=0.2)
    data = collate(groups(), pad_id=0).to_torch()
    data["response_mask"] = data["response_mask"].float()
    with torch.no_grad():
        ref, _ = token_logprobs(model, data, temperature=0.7)
        lay = mb.right_align(data, pad_id=0, multiple=4)
        assert lay["tokens"].shape[1] % 4 == 0
        logits = model(input_ids=lay["tokens"], position_ids=lay["position_ids"]).logits / 0.7
        per_pos = torch.log_softmax(logits, -1).gather(-1, lay["labels"][..., None])[..., 0]
        got = mb.gather_response(per_pos, lay["resp_index"])
    mask = data["response_mask"].bool()
    torch.testing.assert_close(got[mask], ref[mask], atol=1e-5, rtol=1e-5)
    # the response tokens sit right after each row's prompt
    for i, g in enumerate(r for grp in groups() for r in [grp] * grp.n):
        p = len(g.prompt_ids)
        assert lay["tokens"][i, :p].tolist() == list(g.prompt_ids)


def test_entropy_from_vocab_shards_equals_full_entropy():
    logits = torch.randn(3, 5, 64) * 3
    shards = torch.chunk(logits, 4, dim=-1)
    m = torch.stack([s.max(-1).values for s in shards]).max(0).values  # all-reduce MAX
    parts = [mb.entropy_partials(s, m) for s in shards]
    total_s = sum(p[0] for p in parts)  # all-reduce SUM
    total_w = sum(p[1] for p in parts)
    got = mb.entropy_from_partials(m, total_s, total_w)
    torch.testing.assert_close(got, entropy_from_logits(logits), atol=1e-5, rtol=1e-5)


def test_row_shards_cover_every_row_once():
    shards = [mb.shard_rows(10, 4, r) for r in range(4)]
    assert [len(s) for s in shards] == [3, 3, 2, 2]
    assert torch.cat(shards).tolist() == list(range(10))
    assert [m.tolist() for m in mb.micro_batches(torch.arange(5), 2)] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize(
    "name",
    ["qwen2.5-1.5b-math-sglang-megatron", "qwen2.5-7b-math-sglang-megatron", "qwen2.5-7b-math-npu",
     "qwen3-30b-a3b-math-sglang-megatron"],
)  # fmt: skip
def test_recipes_turn_into_megatron_and_sglang_arguments(name):
    """Every production recipe's pass-through config becomes valid Megatron and SGLang args."""
    from pathlib import Path

    from asyncrl.engine import sglang as sl

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / f"{name}.yaml")
    train, infer = cfg.actor_train, cfg.actor_infer
    p = ma.plan(train, cfg.actor.optim, HF, padded_vocab=151936)
    tp = train.strategy_args.strategy_config["tensor_model_parallel_size"]
    pp = train.strategy_args.strategy_config["pipeline_model_parallel_size"]
    assert len(train.device_mapping) % (tp * pp) == 0
    assert p.parallel["tensor_model_parallel_size"] == tp and p.optimizer["bf16"]
    settings = sl.SGLangSettings.parse(infer.strategy_args.strategy_config, infer.model_args.dtype)
    cmd = sl.server_command("/m", 30000, infer.num_gpus_per_worker, settings)
    assert cmd[cmd.index("--tp-size") + 1] == str(infer.num_gpus_per_worker)
    assert cmd[cmd.index("--load-format") + 1] == "dummy" and "--context-length" in cmd
    engines = sl.engine_devices(infer.device_mapping, infer.num_gpus_per_worker)
    assert not set(train.device_mapping) & {d for e in engines for d in e}  # no shared device
    if name.endswith("npu"):
        assert cfg.weight_sync.backend == "hccl"
        assert p.transformer["use_flash_attn"] and p.transformer["sequence_parallel"]


def test_context_parallel_split_is_megatrons_load_balanced_chunking():
    """2·CP chunks; CP rank r holds chunks r and 2·CP-1-r (megatron.core.utils.
    get_batch_on_this_cp_rank), every position exactly once, equal causal work per rank."""
    assert mb.cp_positions(12, 3, 0).tolist() == [0, 1, 10, 11]
    assert mb.cp_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert mb.cp_positions(12, 3, 2).tolist() == [4, 5, 6, 7]
    order = mb.cp_order(16, 2)
    assert sorted(order.tolist()) == list(range(16))
    assert len({int(mb.cp_positions(16, 2, r).sum()) for r in range(2)}) == 1  # balanced
    values = torch.arange(16.0)[None] * 10  # per-position values, gathered back in order
    gathered = torch.cat([values[:, mb.cp_positions(16, 2, r)] for r in range(2)], dim=1)
    assert torch.equal(gathered[:, torch.argsort(order)], values)
    with pytest.raises(ValueError, match="not a multiple of 2 x CP"):
        mb.cp_positions(10, 3, 0)


def test_interleaved_schedule_gets_a_multiple_of_the_pipeline_size():
    """Megatron's interleaved schedule needs the micro-batch count to be a multiple of PP; too
    few rows give dead micro-batches (the filler row, weight 0), never an empty one."""
    filler = torch.tensor([7])
    plain = mb.schedule_micro(torch.arange(5), 2, filler)
    assert [(m.tolist(), live) for m, live in plain] == [([0, 1], 1), ([2, 3], 1), ([4], 1)]
    four = mb.schedule_micro(torch.arange(5), 2, filler, multiple=2)
    assert len(four) == 4 and all(live and len(m) <= 2 for m, live in four)
    assert torch.cat([m for m, _ in four]).tolist() == list(range(5))
    few = mb.schedule_micro(torch.arange(1), 3, filler, multiple=2)
    assert [(m.tolist(), live) for m, live in few] == [([0], True), ([7], False)]
    none = mb.schedule_micro(torch.arange(0), 3, filler)
    assert [(m.tolist(), live) for m, live in none] == [([7], False)]

"""The R3 effect as a measured claim (not a timing): on the warm-started embedded tiny MoE,
rollouts from a bf16 hf engine scored by the fp32 learner (`asyncrl bench mismatch`).

Measured (bench/results/mismatch.json): without replay ~1 % of the positions the engine
forwarded are routed differently by the learner in some layer; with R3 none is, the k3
mismatch KL falls ~3x over all responses and ~7x over the responses where routing differed
(the rest of the mismatch is bf16 arithmetic, which replay cannot remove). Slow: the bench's
full size (64 prompts x 8 samples: ~15 s on an idle 2-core box, a minute on a loaded one) and,
when not cached yet, the model's warm start (~3 CPU minutes)."""

from __future__ import annotations

import json

import pytest

from asyncrl.cli import main


@pytest.mark.slow
def test_r3_removes_the_routing_share_of_the_mismatch(tmp_path):
    assert main(["bench", "mismatch", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "mismatch.json").read_text())
    off, r3 = result["rows"]["off"], result["rows"]["r3"]
    assert off["routes_differ_frac"] > 0 and off["flipped_rows"] > 0  # there is something to fix
    assert r3["routes_differ_frac"] == 0.0  # the replayed forward used the engine's experts
    assert r3["mismatch_k3_kl"] < 0.5 * off["mismatch_k3_kl"]
    assert r3["flipped_mismatch_k3_kl"] <= 0.2 * off["flipped_mismatch_k3_kl"]
    assert r3["is_ess"] >= off["is_ess"] and r3["flipped_is_ess"] >= off["flipped_is_ess"]


def _bench():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import mismatch

    return mismatch


def test_the_bench_shapes_build_through_the_embedded_builder_and_keep_its_key():
    from asyncrl.models.tiny import embedded_spec

    bench = _bench()
    embedded = embedded_spec(arch="moe")
    # the embedded shape at the embedded warm start is the embedded MoE itself (its cache)
    assert bench.model_spec(bench.SHAPES["embedded"], bench.WARM_STEPS) == embedded
    assert bench.WARM_STEPS == embedded.steps
    qwen = bench.model_spec(bench.SHAPES["qwen3-30b-a3b"], bench.WARM_STEPS)
    assert (qwen.num_experts, qwen.experts_per_token) == (128, 8)
    assert qwen.digest() != embedded.digest()
    assert {k: v for k, v in vars(qwen).items() if k not in bench_fields()} == {
        k: v for k, v in vars(embedded).items() if k not in bench_fields()
    }  # only the shape differs: same task, recipe, seed, warm start


def bench_fields() -> set[str]:
    return {"num_experts", "experts_per_token", "moe_intermediate_size"}


def test_the_bench_names_each_shape_s_result_and_refuses_a_shape_it_cannot_route():
    bench = _bench()

    args = bench.build_parser().parse_args

    assert bench.shape_of(args([])) == ("mismatch", bench.SHAPES["embedded"])
    assert bench.shape_of(args(["--shape", "qwen3-30b-a3b"]))[0] == "mismatch_qwen3_30b_a3b"
    assert bench.shape_of(args(["--experts", "32", "--top-k", "4"])) == (
        "mismatch_e32_k4",
        (32, 4, 96),
    )
    assert (
        bench.shape_of(args(["--experts", "32", "--top-k", "4", "--warm-steps", "300"]))[0]
        == "mismatch_e32_k4_warm300"
    )
    with pytest.raises(SystemExit, match="needs --experts and --top-k"):
        bench.shape_of(args(["--top-k", "4"]))
    for shape in ((8, 8, 48), (300, 8, 48), (8, 0, 48)):
        with pytest.raises(SystemExit, match="needs 1 <= top-k < experts <= 255"):
            bench.model_spec(shape, 300)


@pytest.mark.slow
def test_at_qwen3_30b_a3b_routing_r3_removes_every_differing_route(tmp_path):
    """The bench's Qwen3-30B-A3B routing shape (128 experts, top-8; its warm start: ~7 CPU
    minutes when not cached). More routes differ than on the embedded MoE, R3 removes all;
    the KL falls less (bench/results/mismatch_qwen3_30b_a3b.json: 0.46x, the target 0.2x
    missed), so this holds the direction only."""
    argv = ["bench", "mismatch", "--shape", "qwen3-30b-a3b", "--out", str(tmp_path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "mismatch_qwen3_30b_a3b.json").read_text())
    off, r3 = result["rows"]["off"], result["rows"]["r3"]
    assert off["routes_differ_frac"] > 0.02 and r3["routes_differ_frac"] == 0.0
    assert r3["mismatch_k3_kl"] < off["mismatch_k3_kl"]
    assert r3["is_ess"] >= off["is_ess"] and r3["flipped_is_ess"] >= off["flipped_is_ess"]

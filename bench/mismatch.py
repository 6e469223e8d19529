"""Train/inference mismatch of a mixture-of-experts policy, with and without routing replay (R3).

The embedded tiny MoE (`model_args.embedded_arch: moe`, warm-started) samples rollouts in an
hf engine in bf16 (temperature 1, routes returned: `return_routed_experts`); the learner's
fp32 copy of the same weights scores them twice: routing every token itself (`off`) and
replaying the engine's routes (`r3`, `asyncrl.learner.routing`). For each: the mismatch KL
(`mismatch/mismatch_kl`, the sampled mean(rollout - learner) over the response tokens, and the
k3 estimator, which the ratio uses: at this size the sampled mean is mostly noise), the rollout
IS weights' effective sample size (token level, truncated at 2), and the share of positions
(prompt and response tokens the engine forwarded) whose experts in the learner's forward differ
from the engine's in some layer (for r3: the experts the replayed forward USED). The same
figures over `flipped` rows only: the responses where routing without replay differed
somewhere, the only ones R3 can change.

Target (the issue's): r3's mismatch KL <= 0.2x off's; r3's differing share 0.

The MoE's shape (`--shape`, or `--experts/--top-k/--expert-size`): the embedded MoE's
(`EMBEDDED_MOE`: 8 experts, top-2) by default; `qwen3-30b-a3b` routes like Qwen3-30B-A3B (128
experts, top-8; expert width 48 of hidden 128, its 768 of 2048). Every shape is built and
warm-started by the embedded model's builder (`asyncrl.models.tiny`, same task, recipe and
seed; `--warm-steps`, the embedded's 2000 by default), cached under its own key. Each shape
writes its own result (`mismatch.json`: the embedded; `mismatch_qwen3_30b_a3b.json`). The
task's answers end in ~5 tokens: `--ignore-eos` samples every response to `--max-new`.
`--grid` surveys shapes and lengths (`GRID`) into `mismatch_grid.json`.

    asyncrl bench mismatch [--smoke] [--shape embedded|qwen3-30b-a3b] [--prompts 64] [--n 8]
        [--max-new 8] [--ignore-eos] [--warm-steps 2000] [--seed 0] [--grid]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from common import finish, headline, make_parser, print_table

from asyncrl.config.moe_checks import EMBEDDED_MOE

TARGET_RATIO = 0.2
#: Named shapes: (routed experts per layer, router top-k, expert width).
SHAPES = {
    "embedded": (
        EMBEDDED_MOE["num_experts"],
        EMBEDDED_MOE["num_experts_per_tok"],
        EMBEDDED_MOE["moe_intermediate_size"],
    ),
    "qwen3-30b-a3b": (128, 8, 48),
}
#: `--grid`: (experts, top-k) pairs, the experts axis at top-2 and the top-k axis at 64 experts,
#: plus Qwen3-30B-A3B's 128 / top-8; each with expert width 384 // top-k (3x the hidden size
#: active per token, Qwen3-30B-A3B's 8 x 768 of 2048), at (max-new, ignore-eos) lengths. The
#: warm start is shortened to GRID_WARM_STEPS (same recipe) to keep a survey of 6 models to
#: minutes on 2 shared cores; the qwen3-30b-a3b shape at the full warm start too shows what
#: that changes.
GRID = ((8, 2), (32, 2), (64, 2), (64, 4), (64, 8), (128, 8))
GRID_LENGTHS = ((8, False), (32, True))
GRID_WARM_STEPS = 300


def engine_groups(model: Any, prompts: list[list[int]], n: int, params: Any, seed: int) -> list:
    """Each prompt's n samples from an in-process hf engine serving `model`, as the groups a
    rollout worker builds (routes through the reply's own encoding and parser)."""
    from asyncrl.engine.hf import routes
    from asyncrl.engine.hf.batch import Seq
    from asyncrl.engine.hf.engine import HFEngine
    from asyncrl.engine.replies import EngineReplyError, parse_routes
    from asyncrl.types import TrajectoryGroup

    engine = HFEngine(model, max_batch_size=64, seed=seed)
    done, out = threading.Event(), []
    total = len(prompts) * n

    def finished(seq: Seq) -> None:
        out.append(seq)
        if len(out) == total:
            done.set()

    seqs = [
        Seq(f"p{k}-{i}", list(p), params, finished, True, return_routes=True)
        for k, p in enumerate(prompts)
        for i in range(n)
    ]
    engine.start()
    try:
        engine.submit(*seqs)
        if not done.wait(600):
            raise RuntimeError("the engine did not finish the rollouts")
    finally:
        engine.stop()
    if errors := [s.error for s in seqs if s.error]:
        raise RuntimeError(f"engine errors: {errors[:3]}")

    def bad(problem: str) -> EngineReplyError:
        return EngineReplyError("in-process", problem)

    groups = []
    for k, prompt in enumerate(prompts):
        responses = []
        for s in seqs[k * n : (k + 1) * n]:
            rows = len(s.prompt) + len(s.output_ids) - 1
            responses.append({
                "response_ids": s.output_ids, "rollout_logprobs": s.logprobs,
                "versions": [0] * len(s.output_ids), "reward": 0.0,
                "finish_reason": s.finish["type"],
                "routes": parse_routes(routes.reply_field(s), rows, bad),
            })  # fmt: skip
        groups.append(TrajectoryGroup.from_responses(f"p{k}", prompt, responses))
    return groups


def forward(model: Any, groups: list, replay: bool) -> dict[str, Any]:
    """The learner's logprobs of `groups` (routes replayed or not), the experts its forward
    used at each position, and the engine's."""
    from asyncrl import moe
    from asyncrl.learner.collate import collate
    from asyncrl.learner.logprobs import token_logprobs

    data = collate(groups).to_torch()
    data["response_mask"] = data["response_mask"].float()
    engine_routes = data["routes"]
    if not replay:
        del data["routes"]
    tap = moe.tap_of(model)
    tap.reset_stats()
    with torch.no_grad(), tap.recording_routes():
        logp, _ = token_logprobs(model, data, temperature=1.0)
        used = tap.take().view(*engine_routes.shape[:2], tap.layers, tap.top_k)
    return {"data": data, "logp": logp, "used": used.long(), "stats": tap.reset_stats(),
            "given": engine_routes.view_as(used).long()}  # fmt: skip


def differing(run: dict[str, Any]) -> torch.Tensor:
    """[B, T] positions the engine forwarded whose used experts differ from the engine's in
    some layer."""
    from asyncrl.types import UNROUTED

    given, used = run["given"], run["used"]
    routed = (given != UNROUTED).all(-1).all(-1)
    same = (used.sort(-1).values == given.sort(-1).values).all(-1).all(-1)
    return ~same & routed


def metrics(run: dict[str, Any], rows: torch.Tensor | None = None) -> dict[str, float]:
    """Mismatch KL, k3 KL and the IS ESS over the response tokens (of `rows` only, if given)."""
    from asyncrl.algo.importance import RolloutIS, compute_rollout_importance_weights

    data, logp = run["data"], run["logp"]
    mask = data["response_mask"]
    if rows is not None:
        mask = mask * rows[:, None].float()
    _, m = compute_rollout_importance_weights(
        logp, data["rollout_logprobs"], mask, RolloutIS(threshold=2.0)
    )
    return {
        "mismatch_kl": m["mismatch/mismatch_kl"],
        "mismatch_k3_kl": m["mismatch/mismatch_k3_kl"],
        "is_ess": m["mismatch/rollout_is_eff_sample_size"],
        "tokens": float(mask.sum()),
    }


def score(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per mode: the metrics over every response, and over the responses whose row had a
    position routed differently without replay (`flipped`: where R3 can act at all)."""
    flipped = differing(runs["off"]).any(-1)
    out = {}
    for mode, run in runs.items():
        diff = differing(run)
        routed = float(((run["given"] != 255).all(-1).all(-1)).sum())
        out[mode] = {
            **metrics(run),
            "routes_differ_frac": float(diff.sum()) / routed,
            "own_topk_differ_frac": run["stats"]["differ"] / max(1, run["stats"]["replayed"]),
            "flipped_rows": float(flipped.sum()),
            **{f"flipped_{k}": v for k, v in metrics(run, flipped).items()},
        }
    return out


def measure(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Rollouts of the bf16 engine on `args.prompts` held-out prompts, scored off and r3 in
    fp32; plus the responses' mean length."""
    from transformers import AutoModelForCausalLM

    from asyncrl.data.synthetic import EMBEDDED_TASK, make_rows
    from asyncrl.data.tokenizer import model_tokenizer
    from asyncrl.engine.hf.batch import SamplingParams
    from asyncrl.learner import routing
    from asyncrl.models.generate import render_prompts

    torch.manual_seed(args.seed)
    tok = model_tokenizer(model_dir)
    rows = make_rows(EMBEDDED_TASK, "heldout", args.prompts, args.seed)
    texts = render_prompts(tok, [r["prompt"] for r in rows], "none")
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    engine_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    params = SamplingParams(
        max_new_tokens=args.max_new, temperature=1.0, ignore_eos=args.ignore_eos
    )
    groups = engine_groups(engine_model, ids, args.n, params, args.seed)
    learner_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    routing.enable(learner_model)
    out: dict[str, Any] = score(
        {mode: forward(learner_model, groups, mode == "r3") for mode in ("off", "r3")}
    )
    out["response_tokens_mean"] = out["off"]["tokens"] / (args.prompts * args.n)
    return out


def model_spec(shape: tuple[int, int, int], warm_steps: int) -> Any:
    """The embedded MoE's build spec with `shape`'s experts and `warm_steps` steps: the
    embedded MoE's own spec (and cache key) for its shape and steps."""
    from asyncrl.models.tiny import embedded_spec
    from asyncrl.moe import MAX_EXPERTS

    experts, top_k, width = shape
    if not 1 <= top_k < experts <= MAX_EXPERTS:
        raise SystemExit(f"mismatch: shape experts {experts}, top-k {top_k}: needs 1 <= top-k "
                         f"< experts <= {MAX_EXPERTS}")  # fmt: skip
    if width < 1 or warm_steps < 1:
        raise SystemExit(f"mismatch: --expert-size {width}, --warm-steps {warm_steps}: need >= 1")
    spec = embedded_spec(arch="moe")
    return replace(spec, num_experts=experts, experts_per_token=top_k,
                   moe_intermediate_size=width, steps=warm_steps)  # fmt: skip


def shape_of(args: argparse.Namespace) -> tuple[str, tuple[int, int, int]]:
    """(result name, shape) of the arguments: a named `--shape`, or a custom one."""
    custom = (args.experts, args.top_k, args.expert_size)
    if all(v is None for v in custom):
        shape, name = SHAPES[args.shape], "mismatch"
        if args.shape != "embedded":
            name += "_" + args.shape.replace("-", "_")
    elif args.experts is None or args.top_k is None:
        raise SystemExit("mismatch: a custom shape needs --experts and --top-k")
    else:
        width = args.expert_size or 384 // args.top_k
        shape, name = (args.experts, args.top_k, width), f"mismatch_e{args.experts}_k{args.top_k}"
        name += f"_w{width}" if args.expert_size else ""
    if args.warm_steps != WARM_STEPS:
        name += f"_warm{args.warm_steps}"
    return name, shape


def model_dir_of(shape: tuple[int, int, int], warm_steps: int) -> tuple[Path, dict[str, Any]]:
    """The shape's warm-started model (built once, cached) and its build report."""
    from asyncrl.models.tiny import MARKER, ensure_embedded_model

    path = ensure_embedded_model(spec=model_spec(shape, warm_steps))
    report = json.loads((path / MARKER).read_text())
    return path, {"heldout_accuracy": report["heldout_accuracy"], "warm_steps": warm_steps}


def run_one(args: argparse.Namespace, argv: list[str] | None) -> int:
    name, shape = shape_of(args)
    if args.model_dir is not None:
        model_dir, built = args.model_dir, {}
    else:
        model_dir, built = model_dir_of(shape, args.warm_steps)
    result = measure(model_dir, args)
    off, r3 = result["off"], result["r3"]
    ratio = _ratio(r3["mismatch_k3_kl"], off["mismatch_k3_kl"])
    flipped_ratio = _ratio(r3["flipped_mismatch_k3_kl"], off["flipped_mismatch_k3_kl"])
    keys = (
        "mismatch_kl",
        "mismatch_k3_kl",
        "is_ess",
        "routes_differ_frac",
        "flipped_rows",
        "flipped_mismatch_k3_kl",
        "flipped_is_ess",
    )
    print_table(f"mismatch ({name}): bf16 engine vs fp32 learner", ["replay", *keys],
                [[m, *(result[m][k] for k in keys)] for m in ("off", "r3")])  # fmt: skip
    met = bool(ratio <= TARGET_RATIO and r3["routes_differ_frac"] == 0.0)
    experts, top_k, width = shape
    out = {
        "params": {
            "prompts": args.prompts,
            "n": args.n,
            "max_new": args.max_new,
            "ignore_eos": args.ignore_eos,
            "seed": args.seed,
            "model": str(model_dir),
            "shape": {
                "num_experts": experts,
                "experts_per_token": top_k,
                "moe_intermediate_size": width,
            },
            **built,
            "engine_dtype": "bf16",
            "learner_dtype": "fp32",
        },  # fmt: skip
        "rows": {"off": off, "r3": r3},
        "response_tokens_mean": result["response_tokens_mean"],
        "kl_ratio_r3_over_off": ratio,  # k3 KL: the sampled mean(rollout - old) is noise here
        "flipped_kl_ratio_r3_over_off": flipped_ratio,
        "targets": {"kl_ratio_max": TARGET_RATIO, "r3_routes_differ_frac": 0.0},
        "met": met,
        "headline": {
            "kl_ratio_r3_over_off": headline(ratio, higher_is_better=False),
            "off_routes_differ_frac": headline(off["routes_differ_frac"], False),
            "flipped_kl_ratio_r3_over_off": headline(flipped_ratio, higher_is_better=False),
            "r3_is_ess": headline(r3["is_ess"]),
        },
    }
    return finish(name, out, args, argv=argv, bench="mismatch")


def grid_row(args: argparse.Namespace, shape: tuple[int, int, int]) -> dict[str, Any]:
    """One `--grid` cell: the shape's model at `args`' length, the table's figures."""
    model_dir, built = model_dir_of(shape, args.warm_steps)
    result = measure(model_dir, args)
    off, r3 = result["off"], result["r3"]
    row = {
        "experts": shape[0], "top_k": shape[1], "expert_size": shape[2], **built,
        "max_new": args.max_new, "ignore_eos": args.ignore_eos,
        "response_tokens_mean": result["response_tokens_mean"],
        "off_k3_kl": off["mismatch_k3_kl"], "r3_k3_kl": r3["mismatch_k3_kl"],
        "kl_ratio_r3_over_off": _ratio(r3["mismatch_k3_kl"], off["mismatch_k3_kl"]),
        "off_routes_differ_frac": off["routes_differ_frac"],
        "r3_routes_differ_frac": r3["routes_differ_frac"],
        "off_is_ess": off["is_ess"], "r3_is_ess": r3["is_ess"],
        "flipped_rows": off["flipped_rows"],
        "flipped_kl_ratio_r3_over_off": _ratio(
            r3["flipped_mismatch_k3_kl"], off["flipped_mismatch_k3_kl"]),
        "off_mismatch_kl": off["mismatch_kl"], "r3_mismatch_kl": r3["mismatch_kl"],
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def run_grid(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Every `GRID` shape at every `GRID_LENGTHS` length, plus the qwen3-30b-a3b shape at
    `args.warm_steps` (the full warm start): a survey, no headline (nothing to regress)."""
    rows = []
    cells = [((e, k, 384 // k), GRID_WARM_STEPS) for e, k in GRID]
    cells.append((SHAPES["qwen3-30b-a3b"], args.warm_steps))
    for shape, warm in cells:
        for max_new, ignore_eos in GRID_LENGTHS:
            cell = argparse.Namespace(**{**vars(args), "max_new": max_new,
                                         "ignore_eos": ignore_eos, "warm_steps": warm})  # fmt: skip
            rows.append(grid_row(cell, shape))
    keys = ("experts", "top_k", "warm_steps", "response_tokens_mean", "off_k3_kl", "r3_k3_kl",
            "kl_ratio_r3_over_off", "off_routes_differ_frac", "off_is_ess", "r3_is_ess")  # fmt: skip
    print_table("mismatch grid: bf16 engine vs fp32 learner", keys,
                [[r[k] for k in keys] for r in rows])  # fmt: skip
    params = {"prompts": args.prompts, "n": args.n, "seed": args.seed}
    return finish("mismatch_grid", {"params": params, "rows": rows}, args, argv=argv,
                  bench="mismatch")  # fmt: skip


WARM_STEPS = 2000  # the embedded model's warm start (`TinyModelSpec.steps`)


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=8)
    parser.add_argument("--ignore-eos", action="store_true", help="every response --max-new long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="embedded")
    parser.add_argument("--experts", type=int, default=None, help="custom shape: experts")
    parser.add_argument("--top-k", type=int, default=None, help="custom shape: router top-k")
    parser.add_argument("--expert-size", type=int, default=None, help="default 384 // top-k")
    parser.add_argument("--warm-steps", type=int, default=WARM_STEPS)
    parser.add_argument("--grid", action="store_true", help="survey GRID into mismatch_grid")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the shape's")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv  # the result records the command's flags
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.prompts, args.n = 16, 4
    if args.grid and args.model_dir is not None:
        raise SystemExit("mismatch: --grid builds its own models; drop --model-dir")
    with torch.inference_mode(False):
        torch.set_num_threads(1)
        return run_grid(args, argv) if args.grid else run_one(args, argv)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


if __name__ == "__main__":
    raise SystemExit(main())

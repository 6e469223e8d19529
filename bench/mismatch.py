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

    asyncrl bench mismatch [--smoke] [--prompts 64] [--n 8] [--max-new 8] [--seed 0]
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from common import finish, headline, make_parser, print_table

TARGET_RATIO = 0.2


def engine_groups(model: Any, prompts: list[list[int]], n: int, max_new: int, seed: int) -> list:
    """Each prompt's n samples from an in-process hf engine serving `model`, as the groups a
    rollout worker builds (routes through the reply's own encoding and parser)."""
    from asyncrl.engine.hf import routes
    from asyncrl.engine.hf.batch import SamplingParams, Seq
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

    params = SamplingParams(max_new_tokens=max_new, temperature=1.0)
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


def measure(model_dir: Path, prompts: int, n: int, max_new: int, seed: int) -> dict[str, Any]:
    """Rollouts of the bf16 engine on `prompts` held-out prompts, scored off and r3 in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.data.synthetic import EMBEDDED_TASK, make_rows
    from asyncrl.learner import routing
    from asyncrl.models.generate import render_prompts

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = make_rows(EMBEDDED_TASK, "heldout", prompts, seed)
    texts = render_prompts(tok, [r["prompt"] for r in rows], "none")
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    engine_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    groups = engine_groups(engine_model, ids, n, max_new, seed)
    learner_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    routing.enable(learner_model)
    return score({mode: forward(learner_model, groups, mode == "r3") for mode in ("off", "r3")})


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the embedded MoE")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.n = 16, 4
    model_dir = args.model_dir
    if model_dir is None:
        from asyncrl.models.tiny import embedded_spec, ensure_embedded_model

        model_dir = ensure_embedded_model(spec=embedded_spec(arch="moe"))
    with torch.inference_mode(False):
        torch.set_num_threads(1)
        result = measure(model_dir, args.prompts, args.n, args.max_new, args.seed)
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
    print_table("mismatch: bf16 engine vs fp32 learner", ["replay", *keys],
                [[m, *(result[m][k] for k in keys)] for m in ("off", "r3")])  # fmt: skip
    met = bool(ratio <= TARGET_RATIO and r3["routes_differ_frac"] == 0.0)
    out = {
        "params": {
            "prompts": args.prompts,
            "n": args.n,
            "max_new": args.max_new,
            "seed": args.seed,
            "model": str(model_dir),
            "engine_dtype": "bf16",
            "learner_dtype": "fp32",
        },  # fmt: skip
        "rows": result,
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
    return finish("mismatch", out, args, argv=argv)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


if __name__ == "__main__":
    raise SystemExit(main())

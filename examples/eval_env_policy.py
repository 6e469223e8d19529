"""Evaluate a policy (a Hugging Face model directory, e.g. a run's `checkpoints/step_N/hf`) on
held-out seeds of the environment a run config names, through the same engine and episode code
as training. Prints the mean episode return, solved fraction, turns and invalid-action rate.

    python examples/eval_env_policy.py configs/agentic_guess_number.yaml MODEL_DIR \
        [--seeds 64] [--first-seed 1000000] [--temperature 1.0]

Held-out seeds start far above the training range (`env.seed_offset + env.num_seeds`).
"""

from __future__ import annotations

import argparse
import asyncio
import json

from asyncrl.config import load_config
from asyncrl.data.prompts import PromptItem
from asyncrl.engine.hf.launch import launch_hf_server
from asyncrl.metrics.episodes import episode_metrics
from asyncrl.rollout.multiturn import EpisodeBuilder
from asyncrl.startup import rollout_settings


async def evaluate(builder: EpisodeBuilder, seeds: list[int]) -> dict[str, float]:
    items = [PromptItem(f"eval-{s}", [], metadata={"env_seed": s}) for s in seeds]
    try:
        groups = await asyncio.gather(*(builder.build(it) for it in items))
    finally:
        for client in builder.clients:
            await client.close()
    return episode_metrics(groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("model_dir")
    parser.add_argument("--seeds", type=int, default=64)
    parser.add_argument("--first-seed", type=int, default=1_000_000)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    cfg = load_config(args.config, [f"actor_infer.generating_args.temperature={args.temperature}"])
    with launch_hf_server(args.model_dir, dtype="fp32", seed=cfg.seed) as server:
        settings = rollout_settings(cfg, args.model_dir, [server.url])
        seeds = list(range(args.first_seed, args.first_seed + args.seeds))
        metrics = asyncio.run(evaluate(EpisodeBuilder(settings), seeds))
    keys = ("env/episodes", "env/return_mean", "env/solved_frac", "env/turns_mean")
    print(json.dumps({k: round(metrics[k], 4) for k in (*keys, "env/invalid_action_frac")}))


if __name__ == "__main__":
    main()

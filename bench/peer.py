"""asyncrl's CPU default against TRL's GRPOTrainer: completions/s, RL wall time, held-out gain.

Same warm-started embedded model (the one `asyncrl run` uses), the same training prompts in the
same order (asyncrl's `PromptSource` order; TRL's dataset shuffling off), the same reward (the
config's `rollout.reward_fn`), the same budget (configs/default.yaml: 8 prompts x 8 completions
a step, response length 32, temperature 1.0, AdamW settings, one update per generation batch,
token-mean loss, no KL). Four systems per round, alternating, each a fresh subprocess:

  asyncrl_async  `asyncrl run configs/default.yaml` (async.max_staleness 1, its default)
  asyncrl_sync   the same with async.max_staleness=0
  trl_1t/trl_2t  GRPOTrainer with torch.set_num_threads(1) / (2), loss_type "dapo" (its
                 loss is normalised by the active tokens of the whole generation batch: the
                 global token mean, as asyncrl's token-mean), beta 0

Per run: completions/s over the RL phase (steps 2..N: rollout_batch_size x n x (N-1) over the
time between step 1's end and step N's end; asyncrl's step ends from metrics.jsonl rows, TRL's
from a TrainerCallback's on_step_end), that RL wall time, the time from process start to step
1's end (asyncrl's first trained batch), the whole process's wall (start to exit: the command a
user waits for), the box's 1-min load average (sampled every 2 s), and the held-out greedy accuracy
of the final model minus the start model's, both measured by one in-process evaluator
(`asyncrl.models.tiny.evaluate_accuracy` on asyncrl's held-out split), never by a system's
own metric. Ratios: asyncrl ÷ the faster TRL setting, each round and over the rounds' medians.
Like for like, asyncrl runs without its in-loop held-out evaluation (`logging.eval_interval=0`):
TRL's runs evaluate nothing, and the default's evaluation (500 prompts every 5 steps) is more
generation than the training itself (320 completions per 5 steps) on the one engine core.
`--asyncrl-eval` keeps it (the default config as it ships; both figures go in the note).

Needs the `peer` extra (`pip install -c constraints-cpu.txt -e ".[peer]"`).

    asyncrl bench peer [--smoke] [--rounds 2] [--steps 60] [--heldout 200] [--gain-margin 0.05]
                       [--asyncrl-eval] [--asyncrl-override key=value ...]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import finish, headline, make_parser, print_table

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
SYSTEMS = ("asyncrl_async", "asyncrl_sync", "trl_1t", "trl_2t")
TARGETS = {"async": 1.5, "sync": 1.0}  # issue 16 item 0: x the faster TRL setting
WORKER = "_trl-worker"  # the hidden sub-command a TRL run is re-invoked with


def load_cfg(steps: int, overrides: list[str] | None = None) -> Any:
    from asyncrl.config import load_config

    return load_config(CONFIG, [f"max_steps={steps}", *(overrides or [])])


# ---- timing and ratios (pure: tests/test_bench_peer.py) ----------------------------------


def asyncrl_step_ends(rows: list[dict[str, Any]]) -> list[float]:
    """Unix end time of steps 1..N from metrics.jsonl rows. A row's `time` is its step's end
    (seconds since the logger started) and `timestamp` when it was written, which may be later
    (a row waits for its step's evaluation); the smallest `timestamp - time` is therefore the
    closest bound on the logger's start, and every step end is that start + `time`."""
    if not rows:
        raise ValueError("metrics.jsonl holds no row")
    start = min(float(r["timestamp"]) - float(r["time"]) for r in rows)
    ends = {int(r["step"]): start + float(r["time"]) for r in rows if int(r["step"]) >= 1}
    return [ends[s] for s in sorted(ends)]


def rl_phase(step_ends: list[float], completions_per_step: int, started: float) -> dict:
    """Completions/s over steps 2..N (step 1's end to step N's end), that wall time, and the
    time from process start (`started`, unix) to step 1's end."""
    if len(step_ends) < 2:
        raise ValueError(f"the RL phase needs at least 2 steps, got {len(step_ends)}")
    wall = step_ends[-1] - step_ends[0]
    if wall <= 0:
        raise ValueError(f"step end times do not increase: {step_ends[0]} .. {step_ends[-1]}")
    done = completions_per_step * (len(step_ends) - 1)
    return {
        "steps": len(step_ends),
        "completions_per_s": done / wall,
        "rl_wall_s": wall,
        "first_step_s": step_ends[0] - started,
    }


def ratios(runs: dict[str, dict[str, Any]], margin: float) -> dict[str, Any]:
    """asyncrl async and sync ÷ the faster TRL setting (completions/s), against the targets;
    a target holds when the ratio reaches it and the held-out gain is at least TRL's (of that
    faster setting) minus `margin`."""
    trl = max(("trl_1t", "trl_2t"), key=lambda s: runs[s]["completions_per_s"])
    out: dict[str, Any] = {"trl_best": trl}
    for mode, target in TARGETS.items():
        ours = runs[f"asyncrl_{mode}"]
        ratio = ours["completions_per_s"] / runs[trl]["completions_per_s"]
        gain_ok = ours["heldout_gain"] >= runs[trl]["heldout_gain"] - margin
        out[mode] = {"ratio": ratio, "target": target, "gain_ok": gain_ok,
                     "passed": ratio >= target and gain_ok}  # fmt: skip
    return out


def check_trl_order(seen: list[str], rows: list[dict[str, Any]], n: int) -> None:
    """TRL must have scored the rows' prompts in order, each `n` times in a row (its sampler
    unshuffled): else the comparison would not be on the same prompts in the same order."""
    want = [r["prompt"] for r in rows[: len(seen) // n] for _ in range(n)]
    if seen != want or not seen:
        at = next((i for i, (a, b) in enumerate(zip(seen, want)) if a != b), len(seen))
        raise RuntimeError(f"TRL's prompt order differs from asyncrl's at completion {at}")


def median_runs(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per system, the median over rounds of every numeric figure."""
    out: dict[str, dict[str, Any]] = {}
    for system in SYSTEMS:
        keys = [k for k, v in rounds[0][system].items() if isinstance(v, int | float)]
        out[system] = {k: statistics.median(r[system][k] for r in rounds) for k in keys}
    return out


# ---- the same settings for TRL, read from asyncrl's config --------------------------------


def trl_settings(cfg: Any) -> dict[str, Any]:
    """GRPOConfig keyword arguments matching the asyncrl config's budget and optimizer."""
    from asyncrl.config.plan import derive_plan

    plan, train, gen = (
        derive_plan(cfg),
        cfg.actor_train.training_args,
        cfg.actor_infer.generating_args,
    )
    optim, actor = cfg.actor.optim, cfg.actor
    if actor.loss_agg_mode != "token-mean" or actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        raise ValueError("the peer bench compares token-mean loss without KL")
    if plan.optimizer_steps_per_rollout != 1:
        raise ValueError("the peer bench compares one optimizer step per rollout batch")
    return {
        "learning_rate": optim.lr or train.learning_rate,
        "weight_decay": train.weight_decay if optim.weight_decay is None else optim.weight_decay,
        "adam_beta1": optim.betas[0], "adam_beta2": optim.betas[1], "adam_epsilon": optim.eps,
        "max_grad_norm": optim.clip_grad or train.max_grad_norm,
        "lr_scheduler_type": "constant", "warmup_steps": 0,
        "per_device_train_batch_size": plan.per_device_train_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        # one optimizer step per generation batch of rollout_batch_size x n completions
        "steps_per_generation": plan.gradient_accumulation_steps,
        "num_generations": cfg.num_return_sequences_in_group, "num_iterations": actor.ppo_epochs,
        "max_completion_length": cfg.response_length, "temperature": gen.temperature,
        "top_p": gen.top_p, "top_k": max(0, gen.top_k),
        "loss_type": "dapo", "beta": 0.0, "epsilon": actor.clip_ratio,
        "scale_rewards": "group" if cfg.algorithm.norm_adv_by_std_in_grpo else "none",
        "gradient_checkpointing": cfg.actor_train.model_args.actor_checkpointing(),
        "shuffle_dataset": False, "bf16": False, "use_cpu": True, "seed": cfg.seed,
        "max_steps": cfg.max_steps, "report_to": "none", "save_strategy": "no",
        "logging_steps": 1, "disable_tqdm": True,
    }  # fmt: skip


def train_rows(cfg: Any, model_dir: Path) -> list[dict[str, Any]]:
    """The first max_steps x rollout_batch_size prompts in asyncrl's order: text + metadata."""
    from asyncrl.data.prompts import PromptSource

    source = PromptSource(cfg, model_dir)
    items = [source.next_item() for _ in range(cfg.max_steps * cfg.rollout_batch_size)]
    return [{**it.metadata, "prompt": it.prompt_text} for it in items]


def heldout_rows(cfg: Any, n: int) -> list[dict[str, Any]]:
    """The first `n` prompts of asyncrl's held-out split, as evaluate_accuracy's rows."""
    from asyncrl.data.prompts import load_prompt_records

    return [{**r.metadata, "prompt": r.prompt} for r in load_prompt_records(cfg)[1][:n]]


def heldout_accuracy(model_dir: Path, rows: list[dict], cfg: Any, threads: int = 2) -> float:
    """Greedy accuracy of the HF model in `model_dir`: the one evaluator for every system."""
    from transformers import AutoModelForCausalLM

    from asyncrl.data.tokenizer import model_tokenizer
    from asyncrl.models.tiny import evaluate_accuracy
    from asyncrl.threads import torch_threads

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = model_tokenizer(model_dir)
    with torch_threads(threads):
        return evaluate_accuracy(model, tokenizer, rows, cfg.response_length,
                                 template=cfg.actor_train.data_args.template)  # fmt: skip


# ---- the runs -----------------------------------------------------------------------------


def watch(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `cmd` to completion (output to `log`), sampling the 1-min load average every 2 s."""
    started, loads = time.time(), [os.getloadavg()[0]]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        while True:
            try:
                code = proc.wait(timeout=2.0)
                break
            except subprocess.TimeoutExpired:
                loads.append(os.getloadavg()[0])
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {code}:\n{tail}")
    return {"started": started, "process_s": time.time() - started,
            "load_1m": statistics.mean(loads), "load_1m_max": max(loads)}  # fmt: skip


def run_asyncrl(max_staleness: int, ctx: dict[str, Any], out: Path) -> dict[str, Any]:
    """`asyncrl run configs/default.yaml` through the CLI; the final HF model is saved. Its Ray
    gets a temp dir of its own: `ray.init()` without an address joins the cluster another
    process of the box recorded in /tmp/ray, and this bench measures the local default."""
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", str(CONFIG), f"output_dir={out}",
           f"max_steps={ctx['cfg'].max_steps}", f"async.max_staleness={max_staleness}",
           "actor.checkpoint.save_contents=[hf_model]", *ctx["overrides"]]  # fmt: skip
    env = {**os.environ, "RAY_TMPDIR": ctx["ray_tmp"]}
    env.pop("RAY_ADDRESS", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    run = watch(cmd, out.parent / f"{out.name}.log", env)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ends = asyncrl_step_ends(rows)
    hf = out / "checkpoints" / f"step_{ctx['cfg'].max_steps}" / "hf"
    return {**run, "step_ends": ends, "model_dir": hf}


def run_trl(threads: int, spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """GRPOTrainer in a subprocess (this file's hidden worker) on `threads` torch threads."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps({**spec, "threads": threads, "out": str(out)}))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    run = watch([sys.executable, __file__, WORKER, str(out / "spec.json")], out / "run.log", env)
    seen = json.loads((out / "run.json").read_text())
    check_trl_order(seen["prompts"], spec["rows"], spec["grpo"]["num_generations"])
    return {**run, "step_ends": seen["step_ends"], "model_dir": out / "model"}


def trl_worker(spec_path: Path) -> int:
    """The TRL side of one run: GRPOTrainer on the spec's prompts; step ends and the prompts
    scored, in order, to run.json; the final model to model/."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.data.tokenizer import model_tokenizer
    from asyncrl.rewards.registry import get_reward_fn

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    out, reward_fn, ends, seen = Path(spec["out"]), get_reward_fn(spec["reward"]), [], []

    def reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        seen.extend(prompts)
        keys = [k for k in spec["metadata_keys"] if k in columns]
        return [reward_fn(p, c, {k: columns[k][i] for k in keys})
                for i, (p, c) in enumerate(zip(prompts, completions))]  # fmt: skip

    reward.__name__ = spec["reward"]

    class StepEnds(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ends.append(time.time())

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, train_dataset=Dataset.from_list(spec["rows"]),
        processing_class=model_tokenizer(spec["model_dir"]),
        args=GRPOConfig(output_dir=str(out / "trainer"), **spec["grpo"]), callbacks=[StepEnds()],
    )  # fmt: skip
    trainer.train()
    (out / "run.json").write_text(json.dumps({"step_ends": ends, "prompts": seen}))
    trainer.save_model(str(out / "model"))
    return 0


# ---- the bench ----------------------------------------------------------------------------


def measure_round(r: int, ctx: dict[str, Any], tmp: Path) -> dict[str, dict[str, Any]]:
    """One round: the four systems in order, each scored by the same evaluator."""
    cfg, runs = ctx["cfg"], {}
    for system in SYSTEMS:
        out = tmp / f"r{r}-{system}"
        if system.startswith("asyncrl"):
            run = run_asyncrl(0 if system == "asyncrl_sync" else 1, ctx, out)
        else:
            run = run_trl(int(system[-2]), ctx["trl_spec"], out)
        if len(run["step_ends"]) != cfg.max_steps:
            raise RuntimeError(f"{system}: {len(run['step_ends'])} steps, not {cfg.max_steps}")
        acc = heldout_accuracy(run["model_dir"], ctx["heldout"], cfg)
        phase = rl_phase(run["step_ends"], ctx["per_step"], run["started"])
        runs[system] = {**phase, "process_s": run["process_s"], "load_1m": run["load_1m"],
                        "load_1m_max": run["load_1m_max"], "heldout_accuracy": acc,
                        "heldout_gain": acc - ctx["base_accuracy"]}  # fmt: skip
        print(f"round {r} {system}: {phase['completions_per_s']:.1f} completions/s, "
              f"gain {acc - ctx['base_accuracy']:+.3f}, load {run['load_1m']:.2f}", flush=True)  # fmt: skip
    return runs


def _table(rounds: list[dict], margin: float) -> list[list[Any]]:
    rows, labelled = [], [*((str(i), r) for i, r in enumerate(rounds))]
    for label, runs in [*labelled, ("median", median_runs(rounds))]:
        cmp = ratios(runs, margin)
        for s in SYSTEMS:
            m = runs[s]
            mode = s.removeprefix("asyncrl_")
            ratio = cmp[mode]["ratio"] if mode in TARGETS else None
            rows.append([label, s, m["completions_per_s"], m["rl_wall_s"], m["first_step_s"],
                         m["process_s"], m["heldout_gain"], m["load_1m"], ratio,
                         cmp[mode]["passed"] if mode in TARGETS else None])  # fmt: skip
    return rows


def _plot(rounds: list[dict]):
    def draw(fig: Any) -> None:
        ax = fig.subplots()
        width = 0.8 / len(rounds)
        for i, runs in enumerate(rounds):
            xs = [j + i * width for j in range(len(SYSTEMS))]
            ax.bar(xs, [runs[s]["completions_per_s"] for s in SYSTEMS], width, label=f"round {i}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(SYSTEMS))], SYSTEMS)
        ax.set_ylabel("completions / s (RL phase)")
        ax.set_title("asyncrl vs TRL GRPOTrainer, CPU")
        ax.legend()

    return draw


def context(args: Any, steps: int, heldout: int) -> dict[str, Any]:
    """What every round shares: config, prompts, held-out rows, the start model's accuracy."""
    from asyncrl.models.tiny import ensure_embedded_model

    overrides = list(args.asyncrl_override or [])
    if not args.asyncrl_eval:  # TRL evaluates nothing in its runs (see the docstring)
        overrides = ["logging.eval_interval=0", *overrides]
    elif args.smoke:  # a small held-out evaluation inside asyncrl's run
        overrides = ["logging.eval_size=32", *overrides]
    cfg = load_cfg(steps, overrides)
    model_dir = ensure_embedded_model()  # the directory `asyncrl run` resolves to
    rows, held = train_rows(cfg, model_dir), heldout_rows(cfg, heldout)
    meta = sorted({k for row in rows for k in row} - {"prompt"})
    trl_spec = {"model_dir": str(model_dir), "rows": rows, "metadata_keys": meta,
                "reward": cfg.rollout.reward_fn, "grpo": trl_settings(cfg)}  # fmt: skip
    per_step = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
    return {"cfg": cfg, "overrides": overrides, "heldout": held, "trl_spec": trl_spec,
            "per_step": per_step, "model_dir": model_dir,
            "base_accuracy": heldout_accuracy(model_dir, held, cfg)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [WORKER]:
        return trl_worker(Path(argv[1]))
    parser = make_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=None, help="default 2 (smoke: 1)")
    parser.add_argument("--steps", type=int, default=None, help="default 60 (smoke: 3)")
    parser.add_argument("--heldout", type=int, default=None, help="default 200 (smoke: 32)")
    parser.add_argument("--gain-margin", type=float, default=0.05,
                        help="held-out gain counted equal to TRL's down to this much below it")  # fmt: skip
    parser.add_argument("--asyncrl-eval", action="store_true",
                        help="keep asyncrl's in-loop held-out evaluation (TRL runs none)")  # fmt: skip
    parser.add_argument("--asyncrl-override", action="append", metavar="KEY=VALUE",
                        help="an extra `asyncrl run` override (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    rounds_n = args.rounds or (1 if args.smoke else 2)
    steps = args.steps or (3 if args.smoke else 60)
    heldout = args.heldout or (32 if args.smoke else 200)
    with (
        tempfile.TemporaryDirectory(prefix="asyncrl-bench-peer-") as tmp,
        tempfile.TemporaryDirectory(prefix="arp-", dir="/tmp") as ray_tmp,
    ):  # short: socket paths
        ctx = {**context(args, steps, heldout), "ray_tmp": ray_tmp}
        rounds = [measure_round(r, ctx, Path(tmp)) for r in range(rounds_n)]
    med = median_runs(rounds)
    cmp = ratios(med, args.gain_margin)
    print_table(
        f"asyncrl vs TRL GRPOTrainer: {steps} steps x {ctx['per_step']} completions, start "
        f"accuracy {ctx['base_accuracy']:.3f} on {heldout} held-out prompts",
        ["round", "system", "compl/s", "RL wall s", "1st step s", "whole s", "gain", "load 1m",
         "x TRL best", "target met"], _table(rounds, args.gain_margin),
    )  # fmt: skip
    for mode, c in ((m, cmp[m]) for m in TARGETS):
        print(f"asyncrl {mode} / {cmp['trl_best']}: {c['ratio']:.2f}x (target >= {c['target']}x, "
              f"equal gain {'yes' if c['gain_ok'] else 'NO'}): {'PASS' if c['passed'] else 'FAIL'}")  # fmt: skip
    result = {
        "steps": steps, "rounds_n": rounds_n, "heldout_n": heldout, "systems": list(SYSTEMS),
        "base_accuracy": ctx["base_accuracy"], "asyncrl_overrides": ctx["overrides"],
        "trl_settings": ctx["trl_spec"]["grpo"], "rounds": rounds, "median": med,
        "ratios": cmp, "gain_margin": args.gain_margin,
        "headline": {
            "async_vs_trl": headline(cmp["async"]["ratio"], True, "x"),
            "sync_vs_trl": headline(cmp["sync"]["ratio"], True, "x"),
            "asyncrl_async_completions_per_s": headline(med["asyncrl_async"]["completions_per_s"],
                                                        True, "1/s"),
            "asyncrl_async_heldout_gain": headline(med["asyncrl_async"]["heldout_gain"], True, ""),
            # the whole command, process start to exit, against the faster TRL setting's
            "async_whole_vs_trl": headline(
                med["asyncrl_async"]["process_s"] / med[cmp["trl_best"]]["process_s"], False, "x"
            ),
        },
    }  # fmt: skip
    return finish("peer", result, args, _plot(rounds), argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""The capability matrix: every enumerated config value, read from the schema, either is refused
(by `config validate`, or at start-up when this machine lacks what it needs: one line naming
the piece) or runs through the real loop, shrunk, with the effect it promises checked.

`tests/capability.py` finds the values and packs the runnable ones into a few runs; a value
added to the schema is covered the day it is added, or this module fails. The runs share the
module's Ray session; each starts its own engine server (a run owns its engines)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest

from asyncrl.config import load_config
from tests import capability as cap

STEPS = 2
BASE = [
    "max_steps=2",
    "rollout_batch_size=2",
    "num_return_sequences_in_group=3",
    "response_length=6",
    "rollout.num_actors=1",
    "rollout.max_inflight_prompts=2",
    "logging.eval_interval=0",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plots=false",
    "rollout.reward_fn=tests.e2e_rewards:digit_fraction",
    "actor_train.training_args.learning_rate=1e-3",
    "actor_train.model_args.disable_gradient_checkpointing=true",
]
# Environments' own settings for a shrunk episode (the gym adapter needs a gymnasium id).
ENV_CONFIGS = {
    "gym": "{env_id: FrozenLake-v1, make_kwargs: {is_slippery: false}, "
    "action_names: [left, down, right, up]}",
    "guess_number": "{max_guesses: 2}",
}
# Never-rejecting bounds: the criterion is computed (its metric shows) without masking the batch.
RS_BOUND = "upper: 1.0e9"
# The thread budget's values besides auto: integers and a bool, which no Literal enumerates.
THREAD_DIMS = (
    cap.Dimension("threads.learner", ("auto", 1)),
    cap.Dimension("threads.engine", ("auto", 1)),
    cap.Dimension("threads.pin", (True, False)),
)


def with_thread_dims(dims: list[cap.Dimension]) -> list[cap.Dimension]:
    """`dims` with the thread budget's dimensions in place of the schema's auto-only ones."""
    paths = {d.path for d in THREAD_DIMS}
    return [d for d in dims if d.path not in paths] + list(THREAD_DIMS)


class Models:
    policy = "unset"
    other = "unset"
    full_bytes = 0  # the policy's distinct parameters, fp32 (a tied head is sent once)


def to_overrides(choice: dict[str, Any], models: type[Models] = Models) -> list[str]:
    """A planned run's choice → the config overrides that make it (on the shrunk base)."""
    out = [*BASE, f"actor_train.model_args.model_name_or_path={models.policy}"]
    for path, value in choice.items():
        if path == "env":
            if value != cap.OFF:
                out += [
                    f"env.name={value}",
                    f"env.config={ENV_CONFIGS.get(value, '{}')}",
                    "env.max_turns=2",
                    "env.max_tokens_per_turn=4",
                    "response_length=48",
                ]
        elif path in ("critic", "reference"):
            if value == cap.ON:
                model = models.policy if path == "critic" else models.other
                out.append(f"{path}.model_args.model_name_or_path={model}")
        elif path == "algorithm.rollout_rs":
            items = ", ".join(f"{{name: {name}, {RS_BOUND}}}" for name in value)
            out.append(f"algorithm.rollout_rs=[{items}]")
        elif path == "logging.eval_engine" and value == "dedicated":  # 2 engines, evaluations
            out += [f"{path}={value}", "actor_infer.device_mapping=[0,1]"]
            out += ["logging.eval_interval=1", "logging.eval_size=4"]  # small: env runs play 2x
        elif path == "logging.eval_sync" and value != "wait":  # evaluations to pin
            out += [f"{path}={value}", "logging.eval_interval=1", "logging.eval_size=4"]
        else:
            out.append(f"{path}={value}")
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    from asyncrl.models.tiny import TinyModelSpec, build_model, build_tokenizer

    tok = build_tokenizer()
    for seed, name in enumerate(("policy", "other")):  # two inits: the policies differ
        spec = TinyModelSpec(
            hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
            max_position_embeddings=2048,  # the tool environments' native prompts are long
        )  # fmt: skip
        path = tmp_path_factory.mktemp(f"matrix-{name}")
        build_model(dataclasses.replace(spec, seed=seed), tok).save_pretrained(path)
        tok.save_pretrained(path)
        setattr(Models, name, str(path))
        Models.full_bytes = sum(4 * p.numel() for p in build_model(spec, tok).parameters())
    dims = with_thread_dims(cap.dimensions())
    classes = cap.classify(dims, to_overrides)
    return dims, classes, cap.plan_runs(dims, classes, to_overrides)


def test_every_enumerated_value_is_refused_or_runs(matrix):
    dims, classes, runs = matrix
    for dim in dims:
        assert set(classes[dim.path]) == set(dim.values), dim.path
        for verdict in classes[dim.path].values():
            # a refusal is one line naming what is wrong, never empty
            if verdict != "runs":
                assert "\n" not in verdict and len(verdict.split(": ", 1)[1]) > 10, verdict
    runnable = {(d.path, v) for d in dims for v in d.values if classes[d.path][v] == "runs"}
    covered = {
        (path, v)
        for run in runs
        for path, chosen in run.items()
        for v in (chosen if isinstance(chosen, tuple) else (chosen,))
    }
    assert runnable <= covered
    # the things this CPU box cannot run are refused before anything starts, naming the piece
    not_here = {
        (p, v) for p, c in classes.items() for v, verdict in c.items() if "not here" in verdict
    }
    assert ("actor_infer.strategy_args.strategy_name", "sglang") in not_here
    # megatron-core installed or not (the `test` extra has it, for its tests' CPU emulation),
    # a run's Megatron learner needs an accelerator
    assert ("actor_train.strategy_args.strategy_name", "megatron_train") in not_here
    assert ("weight_sync.backend", "nccl") in not_here and (
        "weight_sync.backend",
        "hccl",
    ) in not_here
    # routing replay (r2, r3) needs a mixture-of-experts policy; the matrix's are dense (both
    # run on MoE policies in tests/test_moe_r2.py and tests/test_moe_e2e.py)
    for mode in ("r2", "r3"):
        verdict = classes["actor.router_replay"][mode]
        assert verdict.startswith("refused") and "needs a mixture-of-experts" in verdict, verdict
    # SGLang's native LoRA path: refused on the CPU default's hf engines, naming the way there
    native = classes["weight_sync.lora_sync"]["native"]
    assert native.startswith("refused") and "native is SGLang's LoRA path" in native, native


def _rows(out) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("version") is not None]


def _finite(rows, key) -> bool:
    return all(key in r and r[key] is not None and math.isfinite(r[key]) for r in rows)


def _seen(rows, key) -> list:
    return [r.get(key) for r in rows]


def check_effects(choice: dict[str, Any], rows: list[dict[str, Any]], out=None) -> None:
    """What each chosen value promises, read from the run's metrics (and files in `out`)."""
    assert len(rows) == STEPS and rows[-1]["version"] == STEPS  # the loop ran and synced
    assert _finite(rows, "actor/pg_loss") and _finite(rows, "actor/grad_norm")
    # the first trained step reports the start-up: time to it, the thread budget
    assert rows[0]["time/first_batch_s"] > 0 and "time/first_batch_s" not in rows[1]
    for role in ("learner", "engine"):
        if isinstance(choice.get(f"threads.{role}"), int):
            assert rows[0][f"threads/{role}"] == choice[f"threads.{role}"], rows[0]
    if choice.get("threads.pin") is False:
        assert rows[0]["threads/pinned"] == 0.0
    adv = _seen(rows, "learner/adv_max") + _seen(rows, "learner/adv_min")
    pulled = choice.get("actor.use_kl_loss") and choice.get("reference") == cap.ON
    if any(a != 0 for a in adv) or pulled:  # a signal to learn from: the weights moved
        assert any(r["actor/grad_norm"] > 0 for r in rows), _seen(rows, "actor/grad_norm")
    env = choice.get("env", cap.OFF)
    if env == cap.OFF:  # graded reward on every single-turn run: the advantages carry signal
        if choice.get("rollout.reward_fn") is None:
            assert any(a != 0 for a in adv), adv
    else:
        assert all(r["env/episodes"] > 0 for r in rows)
    if choice.get("critic") == cap.ON:
        assert _finite(rows, "critic/vf_loss") and _finite(rows, "critic/vf_explained_var")
    if choice.get("algorithm.use_kl_in_reward"):
        assert _finite(rows, "actor/reward_kl_penalty"), _seen(rows, "actor/reward_kl_penalty")
    if choice.get("actor.use_kl_loss"):
        assert _finite(rows, "actor/kl_loss")
        if choice.get("reference") == cap.ON:  # another model: the KL is not zero (k1 may be < 0)
            assert any(r["actor/kl_loss"] != 0 for r in rows), _seen(rows, "actor/kl_loss")
    bound = choice.get("async.max_staleness", 1)
    if bound == "auto":  # the controller's bound, in [0, hard], fed by the IS ESS by lag
        assert all(0 <= r["replay/staleness_bound"] <= 4 for r in rows), rows
        assert all("replay/staleness_change" in r for r in rows)
        bound = 4  # async.max_staleness_hard's default: the ceiling
    else:
        assert all(r["replay/staleness_bound"] == bound for r in rows)
    if choice.get("async.stale_policy") == "correct":  # trained past the bound, up to the cap
        bound = 4  # async.max_staleness_hard's default
        assert _finite(rows, "replay/over_bound")
    assert all(r["replay/staleness_max"] <= bound for r in rows), _seen(
        rows, "replay/staleness_max"
    )
    check_token_budget(choice, rows)
    for name in choice.get("algorithm.rollout_rs", ()):
        assert _finite(rows, f"rejection/{name}_fraction")
    if choice.get("actor_train.model_args.lora_rank"):  # adapter-only syncs move far less
        # every sync's bytes (a step whose sync still runs, overlapped, reports it later)
        sent = [b for b in _seen(rows, "sync/bytes") if b is not None]
        assert sent
        merged = choice.get("weight_sync.lora_sync") == "merge"
        assert all(
            b > 0.9 * Models.full_bytes if merged else b < 0.5 * Models.full_bytes for b in sent
        ), sent
    if choice.get("actor.use_dynamic_bsz"):  # packed: no padded token in a training forward
        assert all(r["learner/padding_frac"] == 0.0 for r in rows)
    elif "actor.use_dynamic_bsz" in choice:  # padded: pads wherever lengths differ (a step
        # whose sampled responses all share one length has none to pad)
        assert any(r["learner/padding_frac"] > 0.0 for r in rows), _seen(
            rows, "learner/padding_frac"
        )
    if choice.get("actor.profiler.tool") == "torch" and out is not None:
        assert json.loads((out / "profile" / "step_1.json").read_text())["traceEvents"]
    ranks = 2 if choice.get("actor_train.device_mapping") == "[0,1]" else 1
    assert all(r.get("learner/world_size", 1.0) == ranks for r in rows)
    evaluated = (choice.get("logging.eval_engine"), choice.get("logging.eval_sync"))
    if {"dedicated", "pinned", "auto"} & set(evaluated):  # every step, on its own weights
        assert all(r["eval/version"] == r["step"] for r in rows), _seen(rows, "eval/version")
        assert not any(r.get("rollout/eval_failures") for r in rows), _seen(rows, "eval")
    if choice.get("rollout.worker_pool") == "process":  # child processes of the driver
        assert all(r["rollout/worker_processes"] == 1 for r in rows), rows  # BASE: 1 worker
    elif "rollout.worker_pool" in choice:  # Ray actors or the driver's threads: none of those
        assert not any("rollout/worker_processes" in r for r in rows)
    if choice.get("algorithm.correction_mode") == "bypass":
        assert all(r["mismatch/rollout_is_mean"] == pytest.approx(1.0) for r in rows)
    check_schedules(choice, rows)
    check_engine_tallies(choice, rows)
    check_dtypes(choice, rows)


def check_token_budget(choice: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """A token budget holds the tokens in flight and buffered within it; without one, no
    budget is reported (the buffered tokens are, always)."""
    limit = choice.get("async.max_inflight_tokens")
    assert all(r["replay/tokens_buffered_peak"] >= r["replay/tokens_buffered"] for r in rows)
    if not limit:
        assert not any("replay/token_budget" in r for r in rows)
        return
    assert all(r["replay/token_budget"] == limit for r in rows)
    assert all(0 < r["replay/tokens_held_peak"] <= limit for r in rows), rows
    assert all(r["replay/tokens_held"] <= limit for r in rows)


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def check_dtypes(choice: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """A configured dtype is the dtype the weights are held in: the learner's policy and
    reference (the torch learner reports its tensors per dtype), the engines' (their
    /server_info, through `EngineFleet.metrics`)."""
    torch_learner = choice.get("actor_train.strategy_args.strategy_name") != "megatron_train"
    where = [("actor_infer.model_args.dtype", "engines/params_")]
    if torch_learner:  # the Megatron learner reports no dtype counts
        where += [
            ("actor_train.model_args.dtype", "learner/params_"),
            ("reference.model_args.dtype", "learner/reference_params_"),
        ]
    for path, prefix in where:
        if path not in choice:
            continue
        held = {d: n for d, n in _tallies(rows, prefix).items() if n > 0}
        want = TORCH_DTYPES[choice[path]]
        if choice.get("actor_train.model_args.lora_rank") and prefix == "learner/params_":
            assert held.get(want, 0) > 0, (path, want, held)  # the adapter may differ
        else:
            assert set(held) == {want}, (path, want, held)


def _tallies(rows: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    """The engines' totals under `prefix` (`EngineFleet.metrics`), their last report."""
    out: dict[str, float] = {}
    for row in rows:
        out |= {k.removeprefix(prefix): v for k, v in row.items() if k.startswith(prefix)}
    return out


def check_engine_tallies(choice: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The engines did what the run asked, by their own count: every pause in the pause mode
    (auto: none on hf_infer, whose engines load a sync's buckets between two steps), and every
    weight bucket in the load format (auto on gloo: flattened for the tiny model's tensors,
    which average well under 1 MiB)."""
    mode = choice.get("async.pause_mode", "auto")
    mode = "none" if mode == "auto" else mode  # the matrix's engines are hf_infer
    pauses = {m: n for m, n in _tallies(rows, "engines/pauses_").items() if n > 0}
    assert pauses == ({} if mode == "none" else {mode: pauses.get(mode, 0)}), (mode, pauses)
    assert mode == "none" or pauses[mode] > 0, (mode, pauses)
    fmt = choice.get("weight_sync.load_format", "auto")
    fmt = "flattened_bucket" if fmt == "auto" else fmt
    buckets = {f: n for f, n in _tallies(rows, "engines/buckets_").items() if n > 0}
    assert set(buckets) == {fmt}, (fmt, buckets)


PEAK_LR = 1e-3  # BASE's actor_train.training_args.learning_rate
# The keys that name the actor's schedule (verl's two names fold into actor_train's).
ACTOR_SCHEDULE = (
    "actor_train.training_args.lr_scheduler_type",
    "actor.optim.lr_scheduler_type",
    "actor.optim.warmup_style",
)


def check_schedules(choice: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The learning rate each step reports (after its optimizer steps) follows the named
    schedule: constant stays at the peak, linear and cosine decay over the run's steps. (Over
    two steps both decays pass the midpoint, where they are equal: the learner's `lr_factor`
    tests tell them apart.)"""
    kinds = {choice[p] for p in ACTOR_SCHEDULE if p in choice}
    schedules = [("learner/lr", kinds.pop() if len(kinds) == 1 else None, PEAK_LR)]
    schedules.append(("critic/lr", choice.get("critic.training_args.lr_scheduler_type"), None))
    for key, kind, peak in schedules:
        if kind is None or (key == "critic/lr" and choice.get("critic") != cap.ON):
            continue
        lrs = _seen(rows, key)
        assert None not in lrs, (key, lrs)
        if kind == "constant":
            assert all(lr == pytest.approx(peak or lrs[0]) for lr in lrs), (key, kind, lrs)
        else:  # decays from the first step on, to the floor (min_lr_ratio 0) at the last
            assert lrs[0] < (peak or math.inf) and lrs[-1] < lrs[0], (key, kind, lrs)
            assert lrs[-1] == pytest.approx(0.0, abs=1e-12), (key, kind, lrs)


def test_planned_runs_train(matrix, tmp_path):
    from asyncrl.run import run

    _, _, runs = matrix
    for i, choice in enumerate(runs):
        out = tmp_path / f"run{i}"
        cfg = load_config(None, [*to_overrides(choice), f"output_dir={out}"])
        try:
            run(cfg)
            check_effects(choice, _rows(out), out)
        except Exception as e:
            raise AssertionError(f"run {i} {choice}: {type(e).__name__}: {e}") from e


def _values(path: str) -> tuple[Any, ...]:
    return next(d.values for d in cap.literal_fields() if d.path == path)


# The full cross-product of the rollout-IS settings (the default set covers each value once).
IS_PRODUCT = [
    (level, mode, correction)
    for level in _values("algorithm.rollout_is_level")
    for mode in _values("algorithm.rollout_is_mode")
    for correction in _values("algorithm.correction_mode")
]


@pytest.mark.slow
@pytest.mark.parametrize(("level", "mode", "correction"), IS_PRODUCT)
def test_rollout_is_cross_product_trains(matrix, tmp_path, level, mode, correction):
    from asyncrl.run import run

    choice = {
        "algorithm.rollout_is_level": level,
        "algorithm.rollout_is_mode": mode,
        "algorithm.correction_mode": correction,
        "async.max_staleness": 1,
    }
    run(load_config(None, [*to_overrides(choice), f"output_dir={tmp_path}"]))
    check_effects(choice, _rows(tmp_path))

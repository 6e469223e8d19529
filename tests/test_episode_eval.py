"""Held-out evaluation of multi-turn policies (issue 18, item 3): unseen env seeds, played by the
training episodes' own code (`EpisodeBuilder`), greedy and sampled, pinned to a weight version,
at the evaluation priority; and the real loop logging it into metrics.jsonl.

Faked: only the engine's HTTP edge (`EngineClient.http.call`), which plays a known policy, and a
scripted environment. The Evaluator, the EpisodeBuilder, the client's request/reply code and the
control event loop are real."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from asyncrl.config import load_config
from asyncrl.config.schema import EnvConfig, GeneratingArgs, LoggingConfig
from asyncrl.data.env_prompts import HELDOUT_SEED_BASE, heldout_seeds, seed_rows
from asyncrl.engine.client import EngineClient
from asyncrl.engine.versions import HF_SERVER_VERSION, PIN_KEY
from asyncrl.net import AsyncRunner
from asyncrl.rollout.evaluation import Evaluator, heldout_seed_items
from asyncrl.rollout.settings import RolloutSettings
from asyncrl.run import run

SECRET_ENV = "tests.test_episode_eval:SecretEnv"
TEMPERATURE = 0.7


class SecretEnv:
    """The secret is `seed % 10` and is shown in the prompt (`n=<d>`), so the scripted engine
    can play a known policy. A digit that is right: reward 1, done, solved; a wrong digit: 0,
    "no"; anything else: -0.5, "bad", an invalid action. The builder's max_turns ends it."""

    def reset(self, seed: int) -> str:
        self.secret = seed % 10
        return f"n={self.secret}"

    def step(self, text: str) -> tuple[str, float, bool, dict[str, Any]]:
        answer = text.strip()
        if not answer.isdigit():
            return "bad", -0.5, False, {"invalid_action": True}
        if int(answer) == self.secret:
            return "ok", 1.0, True, {"solved": True}
        return "no", 0.0, False, {}


class BrokenSecretEnv(SecretEnv):
    """SecretEnv whose step raises for the secrets in `broken` (an env bug in some episodes)."""

    def __init__(self, broken: tuple[int, ...] = (3,)) -> None:
        self.broken = broken

    def step(self, text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.secret in self.broken:
            raise RuntimeError("env bug")
        return super().step(text)


def policy(text: str, greedy: bool) -> str:
    """The engine's known policy. Greedy: an invalid "?" first, then the secret. Sampled: the
    secret when it is even, else a wrong digit (every turn)."""
    secret = int(re.search(r"n=(\d)", text).group(1))
    turn = text.count("bad") + text.count("no")  # the feedback so far: turns already played
    if greedy:
        return "?" if turn == 0 else str(secret)
    return str(secret) if secret % 2 == 0 else str((secret + 1) % 10)


def scripted_engine(
    tokenizer: Any, version: int, info: dict | None = None
) -> tuple[EngineClient, list[dict]]:
    """A real client whose HTTP calls are answered: /generate by `policy`, every token at
    `version`; /server_info with `info` (default: an hf server keeping versions, no lease)."""
    sent: list[dict] = []
    client = EngineClient("http://127.0.0.1:9")
    info = {"max_pinned_versions": 2} if info is None else info

    async def call(method, path, body=None, timeout_s=None):
        if path == "/server_info":
            return 200, {"version": HF_SERVER_VERSION, **info}
        assert path == "/generate", path
        sent.append(body)
        if body["sampling_params"]["max_new_tokens"] == 0:  # a lease (rollout/evaluation.py)
            ids = []
        else:
            greedy = body["sampling_params"]["temperature"] == 0.0
            ids = tokenizer.encode(policy(tokenizer.decode(body["input_ids"]), greedy))
            ids.append(tokenizer.eos_token_id)
        meta = {
            "finish_reason": {"type": "stop"},
            "weight_version": str(version),
            "prompt_tokens": len(body["input_ids"]),
            "output_token_weight_versions": [str(version)] * len(ids),
            "output_token_logprobs": [[-0.1, i, None] for i in ids],
        }
        return 200, {"output_ids": ids, "meta_info": meta}

    client.http.call = call
    return client, sent


@pytest.fixture
def runner():
    r = AsyncRunner()  # the control event loop evaluations run on, as in a run
    yield r
    r.close()


def evaluator(
    tiny_model,
    runner,
    engine_version: int,
    size: int = 4,
    env: EnvConfig | None = None,
    info: dict | None = None,
    **log,
):
    from transformers import AutoTokenizer

    env = env or EnvConfig(name=SECRET_ENV, max_turns=3, max_tokens_per_turn=4, template="none")
    settings = RolloutSettings(
        ["http://127.0.0.1:9"], "127.0.0.1", 1, str(tiny_model), env=env,
        generating=GeneratingArgs(temperature=TEMPERATURE), response_length=64, seed=0,
    )  # fmt: skip
    client, sent = scripted_engine(AutoTokenizer.from_pretrained(tiny_model), engine_version, info)
    fleet = SimpleNamespace(
        clients=[client], eval_clients=lambda: [client], runner=runner, heal=lambda source: None
    )
    logging = LoggingConfig(eval_interval=5, eval_size=size, **log)
    return Evaluator(logging, 10, heldout_seed_items(env, size), settings, fleet), sent


@pytest.mark.parametrize(("info", "pinned"), [
    ({"max_pinned_versions": 1, "pinned_version_linger_s": 5.0}, True),
    ({"max_pinned_versions": 1}, False),  # keeps versions, but not between two turns
    ({"max_pinned_versions": 0, "pinned_version_linger_s": 5.0}, False),
])  # fmt: skip
def test_episode_evaluation_is_pinned_only_where_the_engine_leases_versions(
    tiny_model, runner, info, pinned
):
    """An episode's turns come one after another: its requests are pinned (every turn, greedy
    and sampled) only where the engines keep a pinned version and lease it between requests;
    elsewhere they go unpinned and the syncs wait for them (`kept_versions` 0). `pinned` is
    accepted for env runs on hf engines."""
    ev, sent = evaluator(tiny_model, runner, engine_version=3, info=info, eval_sync="auto")
    assert ev.submit(5, 3, source=None)
    [(step, m)] = ev.drain()
    assert step == 5 and m["eval/accuracy"] == 1.0 and ev.kept_versions == int(pinned)
    lease = [b for b in sent if b["sampling_params"]["max_new_tokens"] == 0]
    turns = [b for b in sent if b not in lease]
    assert len(turns) == 16 and [b.get(PIN_KEY) for b in turns] == ["3" if pinned else None] * 16
    # where it pins, the version is held first: a request of no tokens, sent before submit returns
    assert [b.get(PIN_KEY) for b in lease] == (["3"] if pinned else [])
    assert sent[: len(lease)] == lease
    cfg = load_config(None, ["env.name=guess_number", "logging.eval_sync=pinned"])
    assert cfg.logging.eval_sync == "pinned"


def test_pinned_asked_of_engines_that_cannot_lease_says_so_once_and_waits(
    tiny_model, runner, capsys
):
    ev, sent = evaluator(tiny_model, runner, 3, info={"max_pinned_versions": 2}, eval_sync="pinned")
    for step in (5, 10):
        assert ev.submit(step, 3, source=None)
        ev.drain()
    assert ev.kept_versions == 0 and not any(PIN_KEY in body for body in sent)
    said = [x for x in capsys.readouterr().out.splitlines() if "eval_sync: pinned" in x]
    assert len(said) == 1 and "lease none between an episode's turns" in said[0]


def test_heldout_seeds_are_fixed_and_disjoint_from_the_training_seeds():
    env = EnvConfig(name="guess_number", num_seeds=1000, seed_offset=7)
    train = {row["env_seed"] for row in seed_rows(env)}
    held = heldout_seeds(env, 500)
    assert (
        held == heldout_seeds(env, 500) == list(range(HELDOUT_SEED_BASE, HELDOUT_SEED_BASE + 500))
    )
    assert not train & set(held)
    # the same seeds whatever the training range, as long as it stays below the base: curves
    # of runs with other num_seeds / seed_offset are comparable
    assert heldout_seeds(EnvConfig(name="guess_number"), 500) == held
    # a training range reaching the base pushes the held-out seeds past its end: still disjoint
    wide = EnvConfig(name="guess_number", num_seeds=20, seed_offset=HELDOUT_SEED_BASE - 10)
    wide_train = {row["env_seed"] for row in seed_rows(wide)}
    assert not wide_train & set(heldout_seeds(wide, 50))
    assert heldout_seeds(wide, 2) == [HELDOUT_SEED_BASE + 10, HELDOUT_SEED_BASE + 11]
    items = heldout_seed_items(env, 3)
    assert [it.key for it in items] == ["heldout-0", "heldout-1", "heldout-2"]
    assert [it.metadata["env_seed"] for it in items] == held[:3]


def test_scripted_policy_gives_the_exact_greedy_and_sampled_episode_metrics(tiny_model, runner):
    ev, sent = evaluator(tiny_model, runner, engine_version=3)
    assert ev.submit(5, 3, source=None)
    [(step, m)] = ev.drain()
    assert step == 5 and m["eval/version"] == 3.0 and ev.metrics() == {}
    # held-out seeds BASE + 0..3: secrets 0, 1, 2, 3 (BASE is a multiple of 10).
    # greedy: "?" (invalid, -0.5) then the secret (+1): solved in 2 turns, return 0.5
    greedy = {k.removeprefix("eval/greedy/"): v for k, v in m.items() if "/greedy/" in k}
    assert greedy == {
        "solved_frac": 1.0,
        "return_mean": 0.5,
        "invalid_action_frac": 0.5,  # 4 of 8 turns
        "turns_mean": 2.0,
        "episodes_failed": 0.0,
    }
    # sampled: secrets 0, 2 solved at once (return 1, 1 turn); 1, 3 wrong 3 times (0, 3 turns)
    sampled = {k.removeprefix("eval/sampled/"): v for k, v in m.items() if "/sampled/" in k}
    assert sampled == {
        "solved_frac": 0.5,
        "return_mean": 0.5,
        "invalid_action_frac": 0.0,
        "turns_mean": 2.0,
        "episodes_failed": 0.0,
    }
    assert m["eval/accuracy"] == 1.0  # the greedy success rate, what the console plots
    # every turn was an evaluation request: below rollout's priority, greedy or at the run's
    # temperature; 8 greedy turns + 1 + 1 + 3 + 3 sampled turns
    assert all(body["priority"] == -1 for body in sent)
    temps = [body["sampling_params"]["temperature"] for body in sent]
    assert temps.count(0.0) == 8 and temps.count(TEMPERATURE) == 8 and len(sent) == 16
    # a second evaluation plays the same seeds with the same per-request sampling seeds
    # (derived from the items' keys): the same noise every time, so the curve is comparable
    assert ev.submit(10, 3, source=None)
    [(_, again)] = ev.drain()
    assert {k: v for k, v in again.items() if k != "eval/seconds"} == {
        k: v for k, v in m.items() if k != "eval/seconds"
    }
    first, second = sent[:16], sent[16:]
    assert sorted(b["sampling_params"]["sampling_seed"] for b in second) == sorted(
        b["sampling_params"]["sampling_seed"] for b in first
    )


def test_env_errors_fail_their_episodes_and_all_failing_drops_the_evaluation(tiny_model, runner):
    broken = dict(name=SECRET_ENV.replace("SecretEnv", "BrokenSecretEnv"), template="none")
    env = EnvConfig(**broken, max_turns=3, max_tokens_per_turn=4)
    ev, _ = evaluator(tiny_model, runner, engine_version=3, env=env)
    assert ev.submit(5, 3, source=None)
    [(_, m)] = ev.drain()
    # secret 3's episodes failed: counted, and left out of the rates (the other three as in
    # the test above: greedy solves each in 2 turns; sampled solves 0 and 2, fails 1)
    assert m["eval/greedy/episodes_failed"] == m["eval/sampled/episodes_failed"] == 1.0
    assert m["eval/greedy/solved_frac"] == 1.0 and m["eval/greedy/turns_mean"] == 2.0
    assert m["eval/sampled/solved_frac"] == pytest.approx(2 / 3)
    assert m["eval/sampled/turns_mean"] == pytest.approx(5 / 3)
    env.config = {"broken": tuple(range(10))}
    ev, _ = evaluator(tiny_model, runner, engine_version=3, env=env)
    assert ev.submit(5, 3, source=None) and ev.drain() == []
    assert ev.metrics() == {"rollout/eval_failures": 1.0}


def test_an_evaluation_that_ran_under_another_version_is_dropped(tiny_model, runner):
    ev, _ = evaluator(tiny_model, runner, engine_version=4)  # an engine relaunched mid-way
    assert ev.submit(5, 3, source=None)
    assert ev.drain() == []
    assert ev.metrics() == {"rollout/eval_off_version": 1.0}


def test_real_loop_logs_heldout_episode_metrics_into_metrics_jsonl(tiny_model, tmp_path):
    """configs/agentic_guess_number.yaml, shrunk (tiny random model, 2 steps, small batch):
    the evaluation at the start and every step lands in its step's row, pinned to its version."""
    recipe = Path(__file__).parents[1] / "configs/agentic_guess_number.yaml"
    overrides = [
        f"actor_train.model_args.model_name_or_path={tiny_model}",
        f"output_dir={tmp_path}",
        "max_steps=2",
        "rollout_batch_size=2",
        "num_return_sequences_in_group=2",
        "rollout.max_inflight_prompts=2",
        "actor_train.training_args.warmup_steps=0",
        "logging.eval_interval=1",
        "logging.eval_size=3",
        "logging.console=false",
        "logging.tensorboard=false",
        "logging.plots=false",
    ]
    summary = run(load_config(recipe, overrides))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["eval/version"] for r in rows] == [0.0, 1.0, 2.0]
    for r in rows:
        for mode in ("greedy", "sampled"):
            assert 0.0 <= r[f"eval/{mode}/solved_frac"] <= 1.0
            assert 0.0 <= r[f"eval/{mode}/invalid_action_frac"] <= 1.0
            assert 1.0 <= r[f"eval/{mode}/turns_mean"] <= 4.0  # env.max_turns
            # from 4 invalid answers (-0.1 each) to solved at once (+1)
            assert -0.4 - 1e-9 <= r[f"eval/{mode}/return_mean"] <= 1.0
            assert r[f"eval/{mode}/episodes_failed"] == 0.0
        assert r["eval/accuracy"] == r["eval/greedy/solved_frac"]
    assert summary["eval_count"] == 3
    # pinned (the hf server leases each version between an episode's turns): none refused
    assert not any(
        r.get("rollout/eval_failures") or r.get("rollout/eval_off_version") for r in rows
    )


def test_frozenlake_reports_success_on_the_goal_only():
    """Success is the env's own signal: FrozenLake's goal; a hole ends the episode unsolved."""
    from asyncrl.envs.frozenlake import FrozenLakeEnv

    lake = FrozenLakeEnv(random_map=False, map_name="4x4")  # SFFF / FHFH / FFFH / HFFG
    lake.reset(0)
    steps = [lake.step(a) for a in ("down", "down", "right", "right", "down", "right")]
    assert [info["solved"] for *_, info in steps] == [False] * 5 + [True]
    assert steps[-1][1:3] == (1.0, True)
    lake.reset(0)
    lake.step("right")
    _, reward, done, info = lake.step("down")  # (1, 1) is a hole
    assert (reward, done, info["solved"]) == (0.0, True, False)
    assert "solved" not in lake.step("jump")[3]  # an invalid action is not a step of the lake


class _Chain:
    """A gymnasium-like edge: action 1 ends the episode with gymnasium's `is_success`."""

    action_space = SimpleNamespace(n=2)

    @property
    def unwrapped(self):
        return self

    def reset(self, seed=None):
        return 0, {}

    def step(self, action):
        return 0, 0.0, action == 1, False, {"is_success": action == 1}

    def close(self):
        pass


def test_gym_adapter_success_from_success_reward_or_is_success():
    from asyncrl.envs.gym_adapter import GymTextEnv

    env = GymTextEnv(make_fn=lambda seed: _Chain(), render=lambda e, obs: str(obs))
    env.reset(0)
    assert env.step("0")[3]["solved"] is False and env.step("1")[3]["solved"] is True
    # with success_reward, a terminating step must pay at least that much (here it pays 0)
    env = GymTextEnv(make_fn=lambda seed: _Chain(), render=lambda e, o: str(o), success_reward=1)
    env.reset(0)
    assert env.step("1")[3]["solved"] is False

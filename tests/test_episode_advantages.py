"""Episode returns and advantages (trajectory-level and per-step), and the env config section."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.algo.episode import (
    EPISODE_ESTIMATORS,
    episode_return,
    per_step_advantages,
    returns_to_go,
    trajectory_advantages,
)
from asyncrl.config import ConfigError, load_config, validate
from asyncrl.metrics.episodes import episode_metrics


def test_episode_return_modes():
    assert episode_return([0.1, 0.0, 1.0], "sum") == pytest.approx(1.1)
    assert episode_return([0.1, 0.0, 1.0], "final") == 1.0
    assert episode_return([], "final") == 0.0
    with pytest.raises(ValueError):
        episode_return([1.0], "mean")


def test_returns_to_go_discounted():
    assert returns_to_go([1.0, 0.0, 2.0], 0.5).tolist() == [1.5, 1.0, 2.0]


def test_trajectory_advantages_exclude_failed_episodes():
    adv = trajectory_advantages([1.0, 0.0, 5.0, 0.0], [True, True, False, True], "grpo")
    valid = np.array([1.0, 0.0, 0.0])
    expected = (valid - valid.mean()) / (valid.std(ddof=1) + 1e-6)
    assert adv[[0, 1, 3]] == pytest.approx(expected, abs=1e-5) and adv[2] == 0
    dr = trajectory_advantages([1.0, 0.0], [True, True], "drgrpo")
    assert dr.tolist() == [0.5, -0.5]
    rloo = trajectory_advantages([1.0, 0.0, 0.0], [True] * 3, "rloo")
    assert rloo == pytest.approx([1.0, -0.5, -0.5])


def test_per_step_advantages_group_normalised_over_turns():
    rewards = [[0.0, 1.0], [0.0, 0.0, 0.0], [1.0]]
    adv = per_step_advantages(rewards, [True, True, False], "drgrpo", gamma=1.0)
    pool = np.array([1.0, 1.0, 0.0, 0.0, 0.0])  # returns-to-go of the two valid episodes
    assert np.concatenate(adv[:2]) == pytest.approx(pool - pool.mean())
    assert adv[2].tolist() == [0.0]
    with pytest.raises(ValueError, match="episode advantages"):
        per_step_advantages(rewards, [True] * 3, "gae")


def test_episode_estimators_match_config_validation():
    assert EPISODE_ESTIMATORS == validate.EPISODE_ESTIMATORS


def test_env_section_loads_and_validates():
    cfg = load_config(None, ["env.name=frozenlake", "env.config={size: 3, is_slippery: true}"])
    assert cfg.env.config == {"size": 3, "is_slippery": True} and cfg.env.max_turns == 8
    assert load_config().env is None
    assert load_config(None, ["env.name=my_pkg.envs:Maze"]).env.name == "my_pkg.envs:Maze"


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["env.max_turns=3"], "env.name: set one of"),
        (["env.name=chess"], "'chess' is not one of"),
        (["env.name=gym", "env.max_turns=0"], "env.max_turns must be > 0"),
        (["env.name=gym", "env.gamma=1.5"], "env.gamma"),
        (["env.name=gym", "env.advantage_mode=td"], "env.advantage_mode"),
        (
            [
                "env.name=gym",
                "env.advantage_mode=per_step",
                "algorithm.adv_estimator=reinforce_plus_plus",
            ],
            "(with env",
        ),
        (["env.name=gym", "algorithm.overlong_buffer_len=4"], "not supported with env"),
        (["env.name=gym", "env.typo=1"], "unknown key 'env.typo'"),
    ],
)
def test_env_config_errors(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert fragment in str(info.value)


def test_episode_metrics_from_group_metadata():
    class G:
        def __init__(self, meta):
            self.metadata = meta

    groups = [
        G({"env/episodes": 4, "env/failed": 1, "env/timeouts": 1, "env/turns": 8,
           "env/solved": 2, "env/return_sum": 2.0, "env/generated_tokens": 30,
           "env/observation_tokens": 10}),
        G({"prompt_key": "single-turn"}),
    ]  # fmt: skip
    m = episode_metrics(groups)
    assert m["env/episodes_failed"] == 1 and m["env/step_timeouts"] == 1
    assert m["env/return_mean"] == pytest.approx(2 / 3) and m["env/turns_mean"] == 2
    assert m["env/observation_token_frac"] == pytest.approx(0.25)
    assert episode_metrics([G({})]) == {}


def test_env_run_prompts_are_seeds_and_a_bad_env_config_fails_at_start():
    from asyncrl.data.env_prompts import seed_rows

    env = load_config(None, ["env.name=guess_number", "env.num_seeds=3", "env.seed_offset=7"]).env
    assert seed_rows(env) == [{"env_seed": 7}, {"env_seed": 8}, {"env_seed": 9}]
    bad = load_config(None, ["env.name=guess_number", "env.config={hi: 3}"]).env
    with pytest.raises(ConfigError, match=r"env: env 'guess_number': bad config \['hi'\]"):
        seed_rows(bad)

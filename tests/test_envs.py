"""The environment contract, the registry and every built-in environment's reset/step logic."""

from __future__ import annotations

import pytest

from asyncrl.envs import EnvError, as_messages, env_names, make_env, resolve_env
from asyncrl.envs.base import check_step
from asyncrl.envs.gym_adapter import parse_action
from asyncrl.envs.sokoban import LEVELS, generate, parse_level, render, solve


# -- contract and registry -----------------------------------------------------------------------
def test_observations_normalise_to_messages():
    assert as_messages("hi") == [{"role": "user", "content": "hi"}]
    assert as_messages({"role": "tool", "content": "4"}) == [{"role": "tool", "content": "4"}]
    for bad in ([], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 3}], 5):
        with pytest.raises(EnvError):
            as_messages(bad)


def test_check_step_validates_the_tuple():
    assert check_step(("obs", 1, 0, None)) == ([{"role": "user", "content": "obs"}], 1.0, False, {})
    assert check_step(("", 1.0, True, {}))[0] == []  # a final step may say nothing
    for bad in (("obs", 1.0, False), ("obs", "x", False, {}), ("obs", float("inf"), False, {})):
        with pytest.raises(EnvError):
            check_step(bad)


def test_registry_by_name_and_dotted_path():
    assert set(env_names()) == {"frozenlake", "sokoban", "guess_number", "math_tool", "gym"}
    env = make_env("tests.env_fixtures:ScriptedEnv", {"turns": 2})
    assert env.turns == 2
    assert resolve_env("guess_number").__name__ == "GuessNumberEnv"


@pytest.mark.parametrize(
    ("name", "config", "fragment"),
    [
        ("nope", {}, "unknown env 'nope'"),
        ("tests.env_fixtures:Missing", {}, "no callable 'Missing'"),
        ("no_such_pkg.mod:Env", {}, "cannot import module"),
        ("a b:C", {}, "must look like"),
        ("guess_number", {"bogus": 1}, "bad config ['bogus']"),
        ("collections:OrderedDict", {}, "no reset(seed) and step(action)"),
    ],
)
def test_registry_errors_are_one_line(name, config, fragment):
    with pytest.raises(EnvError) as info:
        make_env(name, config)
    assert fragment in str(info.value) and "\n" not in str(info.value)


# -- FrozenLake and the gymnasium adapter --------------------------------------------------------
def test_frozenlake_fixed_map_reaches_goal_and_falls_in_hole():
    env = make_env("frozenlake", {"random_map": False})
    first = env.reset(0)
    assert "PFFF\nFHFH\nFFFH\nHFFG" in first and "left, down, right, up" in first
    for move in ("right", "right", "down", "down", "down"):
        obs, reward, done, _ = env.step(f"I move {move}.")
        assert reward == 0 and not done
    obs, reward, done, _ = env.step("right")
    assert (reward, done) == (1.0, True) and obs.endswith("P")
    env.reset(0)
    env.step("down")
    _, reward, done, _ = env.step("right")  # (1, 1) is a hole
    assert (reward, done) == (0.0, True)


def test_frozenlake_random_maps_are_seeded_and_invalid_actions_answered():
    a, b = make_env("frozenlake", {}), make_env("frozenlake", {})
    assert a.reset(5) == b.reset(5)
    assert any(a.reset(s) != a.reset(5) for s in range(6, 12))
    obs, reward, done, info = a.step("jump!")
    assert "Invalid action" in obs and not done and info["invalid_action"]


def test_gym_adapter_any_discrete_text_env():
    env = make_env(
        "gym", {"env_id": "CliffWalking-v1", "action_names": ["up", "right", "down", "left"]}
    )
    first = env.reset(0)
    assert "\x1b" not in first and "x" in first and "Actions: up, right, down, left." in first
    obs, reward, done, info = env.step("up")
    assert reward == -1.0 and not done and info["action"] == 0
    by_index = make_env("gym", {"env_id": "CliffWalking-v1"})
    assert "integer from 0 to 3" in by_index.reset(0)
    assert by_index.step("2")[3]["action"] == 2
    with pytest.raises(EnvError, match="gymnasium.make"):
        make_env("gym", {"env_id": "NoSuchEnv-v9"}).reset(0)


def test_parse_action():
    names = ["left", "down", "right", "up"]
    assert parse_action("go Right then up", names, 4) == 2  # earliest mention wins
    assert parse_action("upward", names, 4) is None  # whole words only
    assert parse_action("3", names, 4) == 3 and parse_action("7", names, 4) is None


# -- Sokoban ---------------------------------------------------------------------------------
def test_sokoban_push_solves_and_walls_block():
    env = make_env("sokoban", {"level": 0})
    assert "#@$.#" in env.reset(0)
    obs, reward, done, _ = env.step("left")  # into the wall: nothing moves
    assert "#@$.#" in obs and reward == 0 and not done
    obs, reward, done, info = env.step("right")
    assert obs == "#####\n#_@*#\n#####" and done and info["solved"]
    assert reward == pytest.approx(0.1 + 1.0)


def test_sokoban_box_cannot_be_pushed_into_box_or_wall():
    board = parse_level("######\n#@$$.#\n#___.#\n######")
    from asyncrl.envs.sokoban import move

    assert move(board, "right") == board
    assert render(parse_level(LEVELS[1])) == LEVELS[1]


def test_sokoban_generated_rooms_are_seeded_and_solvable():
    for seed in range(10):
        board = generate(seed, 4, 4, 1, 8)
        assert board == generate(seed, 4, 4, 1, 8) and not board.solved
        assert solve(board, 8) is not None
    env = make_env("sokoban", {"boxes": 2, "width": 4, "height": 3, "max_solution_steps": 12})
    env.reset(1)
    assert len(env.board.boxes) == 2 and solve(env.board, 12) is not None


# -- guess the number --------------------------------------------------------------------------
def test_guess_number_binary_search_wins():
    env = make_env("guess_number", {"low": 0, "high": 9, "max_guesses": 4})
    for seed in range(20):
        assert env.reset(seed) == "Guess my number from 0 to 9."
        low, high, done, reward = 0, 9, False, 0.0
        while not done:
            guess = (low + high) // 2
            hint, reward, done, _ = env.step(f"{guess}")
            if hint == "higher":
                low = guess + 1
            elif hint == "lower":
                high = guess - 1
        assert reward == 1.0 and hint == "correct"


def test_guess_number_limits_and_invalid_answers():
    env = make_env("guess_number", {"max_guesses": 2, "invalid_reward": -0.5})
    env.reset(0)
    obs, reward, done, info = env.step("no idea")
    assert reward == -0.5 and not done and info["invalid_action"] and "0 to 9" in obs
    wrong = (env.secret + 1) % 10
    _, reward, done, _ = env.step(str(wrong))
    assert done and reward == 0.0


def test_shipped_guess_number_recipe_gives_invalid_answers_a_gradient():
    """Issue 18: with an invalid or empty answer scored 0 like a wrong guess, a policy answering
    an immediate EOS every turn scored exactly like one still guessing: groups of all-equal
    returns, no gradient, and the run sat in that state. The shipped recipe scores an invalid
    answer below a wrong one, and its estimator does not divide the group's small reward
    differences by their std (which turned that penalty into full-size advantages)."""
    from pathlib import Path

    from asyncrl.config import load_config

    cfg = load_config(Path(__file__).parents[1] / "configs/agentic_guess_number.yaml", [])
    env = make_env(cfg.env.name, cfg.env.config)
    env.reset(0)
    _, empty, done, info = env.step("")  # the model's turn was an immediate EOS
    assert info["invalid_action"] and not done
    _, estimate, _, info = env.step("~20")  # the warm-start's estimate style, out of range
    assert info["invalid_action"] and estimate == empty
    _, wrong, _, info = env.step(str((env.secret + 1) % 10))
    assert not info.get("invalid_action") and empty < wrong
    # a 2-token turn leaves of the warm-start's estimate "~20" a valid guess, "~2"
    assert cfg.env.max_tokens_per_turn == 2
    _, _, _, info = env.step("~2")
    assert not info.get("invalid_action")
    assert cfg.algorithm.adv_estimator == "drgrpo"
    assert cfg.actor.entropy_coeff > 0


# -- math with the calculator ------------------------------------------------------------------
def test_math_tool_episode():
    env = make_env("math_tool", {"max_tool_calls": 1, "max_attempts": 2})
    first = env.reset(0)
    assert first[0]["role"] == "system" and "<tools>" in first[0]["content"]
    problem = first[1]["content"].split("What is ")[1].split("?")[0]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    obs, reward, done, _ = env.step(call % problem)
    assert obs == [{"role": "tool", "content": str(env.answer)}] and not done and reward == 0
    obs, reward, done, _ = env.step("12345678")
    assert obs == "incorrect" and not done  # a second attempt is allowed
    obs, reward, done, _ = env.step(f"The answer is {env.answer}.")
    assert (obs, reward, done) == ("correct", 1.0, True)


def test_math_tool_budget_and_no_tool_description():
    env = make_env("math_tool", {"max_tool_calls": 1, "describe_tools": False})
    assert [m["role"] for m in env.reset(3)] == ["user"]
    bad = "<tool_call>{bad json}</tool_call>"
    obs, _, done, _ = env.step(bad)
    assert obs[0]["content"].startswith("error:") and not done
    _, reward, done, info = env.step(bad)
    assert done and reward == 0 and info["over_tool_budget"]


# -- the user-defined example ------------------------------------------------------------------
def test_example_custom_env_by_dotted_path():
    from pathlib import Path

    source = Path(__file__).resolve().parent.parent / "examples" / "custom_env.py"
    assert len(source.read_text().splitlines()) < 60
    env = make_env("examples.custom_env:NumberWalkEnv", {"max_target": 20})
    assert env.reset(1) == "Reach 6 from 3. Moves: +1, -1, x2."
    assert env.step("x2")[1:3] == (1.0, True)
    assert env.step("walk")[3]["invalid_action"]

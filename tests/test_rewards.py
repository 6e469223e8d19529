import importlib.util

import pytest

from asyncrl.rewards import RewardError, RewardFn, builtin_rewards, get_reward_fn, reward_names
from asyncrl.rewards.arithmetic import parse_first_integer


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("357<|im_end|>", 1.0),
        ("357", 1.0),
        (" 357 and more", 1.0),
        ("0357", 1.0),
        ("35<|im_end|>7", 0.0),  # digits after the end marker are not the answer
        ("358<|im_end|>", 0.0),
        ("<|im_end|>357", 0.0),
        ("", 0.0),
        ("abc", 0.0),
        ("12 357", 0.0),  # the first number counts
    ],
)
def test_arithmetic_exact(response, expected):
    fn = get_reward_fn("arithmetic_exact")
    assert fn("12+345=", response, {"answer": "357"}) == expected


def test_arithmetic_exact_int_and_negative_answers():
    fn = get_reward_fn("arithmetic_exact")
    assert fn("p", "-4<|endoftext|>", {"answer": -4}) == 1.0
    assert parse_first_integer("x=-12, y=3") == -12
    assert parse_first_integer("none") is None


def test_arithmetic_exact_bad_metadata():
    fn = get_reward_fn("arithmetic_exact")
    with pytest.raises(RewardError, match="'answer' metadata"):
        fn("p", "1", {})
    with pytest.raises(RewardError, match="not an integer"):
        fn("p", "1", {"answer": "x"})


def test_format_integer():
    fn = get_reward_fn("format_integer")
    assert fn("p", "42<|im_end|>", {}) == 1.0
    assert fn("p", "42 apples", {}) == 0.0


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("130<|im_end|>", "130", 1.0),  # exact: full reward
        ("126<|im_end|>", "130", 0.5 * 1 / 3),  # only the hundreds digit matches
        ("31", "32", 0.5 * 1 / 2),
        ("1300", "130", 0.5 * 1 / 4),  # the longer of the two counts
        ("-5", "5", 0.5 * 1 / 2),  # the sign takes a place
        ("999", "130", 0.0),
        ("no number", "5", 0.0),
    ],
)
def test_arithmetic_partial_credits_matching_digits_below_exact(response, answer, expected):
    fn = get_reward_fn("arithmetic_partial")
    assert fn("p", response, {"answer": answer}) == pytest.approx(expected)
    assert (fn("p", response, {"answer": answer}) == 1.0) == (expected == 1.0)


def test_registry_names_and_errors():
    assert {"arithmetic_exact", "math_verify", "format_integer"} <= set(reward_names())
    with pytest.raises(RewardError, match="valid names: arithmetic_exact") as err:
        get_reward_fn("nope")
    assert "\n" not in str(err.value)
    # Built fresh on every call: mutating one copy cannot change what others see.
    builtin_rewards().clear()
    assert "arithmetic_exact" in builtin_rewards()
    assert isinstance(get_reward_fn("arithmetic_exact"), RewardFn)


def test_dotted_path():
    fn = get_reward_fn("asyncrl.rewards.arithmetic:arithmetic_exact")
    assert fn("1+1=", "2", {"answer": "2"}) == 1.0
    for spec, msg in [
        ("no_such_module_xyz:f", "cannot import module"),
        ("asyncrl.rewards.arithmetic:nope", "no attribute 'nope'"),
        ("asyncrl.rewards.arithmetic:END_MARKERS", "not callable"),
        ("asyncrl.rewards.arithmetic:", "package.module:function"),
    ]:
        with pytest.raises(RewardError, match=msg):
            get_reward_fn(spec)


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is not None, reason="installed")
def test_math_verify_missing_names_the_package():
    with pytest.raises(RewardError, match="math-verify"):
        get_reward_fn("math_verify")


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="not installed")
def test_math_verify_installed():
    fn = get_reward_fn("math_verify")
    assert fn("What is 1/2+1/4?", "The answer is $\\frac{3}{4}$", {"answer": "0.75"}) == 1.0
    assert fn("What is 1/2+1/4?", "The answer is $\\frac{1}{4}$", {"answer": "0.75"}) == 0.0


def test_check_reward_resolves_without_building(tmp_path, monkeypatch):
    from asyncrl.rewards import check_reward

    check_reward("math_verify")  # a name: its optional package is needed only when built
    check_reward("asyncrl.rewards.arithmetic:arithmetic_exact")
    with pytest.raises(RewardError, match="valid names: arithmetic_exact"):
        check_reward("nope")
    (tmp_path / "broken_reward_module.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="cannot import module .*SyntaxError") as err:
        check_reward("broken_reward_module:f")
    assert "\n" not in str(err.value)


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="math-verify absent")
def test_math_verify_scores_off_the_main_thread():
    """A rollout worker scores on its event-loop thread, where math-verify's signal-based
    timeouts cannot run: the reward must still answer there, not raise."""
    import threading

    from asyncrl.rewards import get_reward_fn

    fn, scores = get_reward_fn("math_verify"), []
    worker = threading.Thread(
        target=lambda: scores.extend(
            [fn("p", "so x = \\frac{1}{2}", {"answer": "0.5"}), fn("p", "x = 3", {"answer": "4"})]
        )
    )
    worker.start()
    worker.join(timeout=60)
    assert scores == [1.0, 0.0]

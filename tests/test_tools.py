"""Tool-call parsing, tool execution as observations, and the calculator's safety."""

from __future__ import annotations

import json

import pytest

from asyncrl.envs.tools import (
    CalculatorError,
    Tool,
    ToolCall,
    ToolCallError,
    calculator_tool,
    parse_tool_calls,
    run_tool_calls,
    safe_eval,
    tools_prompt,
)


def call(name: str, args: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def boom(x: int) -> str:
    raise RuntimeError("tool exploded")


TOOLS = {
    "calculator": calculator_tool(),
    "boom": Tool(
        "boom", "raises", {"type": "object", "properties": {"x": {"type": "integer"}}}, boom
    ),
}


def test_valid_calls_in_order_with_text_around():
    text = "Let me compute. " + call("calculator", {"expression": "12*7"}) + " and "
    text += '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2**10\\"}"}</tool_call>'
    calls = parse_tool_calls(text)
    assert calls == [
        ToolCall("calculator", {"expression": "12*7"}),
        ToolCall("calculator", {"expression": "2**10"}),
    ]
    assert run_tool_calls(text, TOOLS) == [
        {"role": "tool", "content": "84"},
        {"role": "tool", "content": "1024"},
    ]


def test_no_tool_call_is_none():
    assert parse_tool_calls("the answer is 84") == []
    assert run_tool_calls("the answer is 84", TOOLS) is None


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", '{"name"'),
        ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": "{x"}</tool_call>', "not JSON"),
        ('<tool_call>{"name": "calculator"', "unterminated"),
        (call("search", {"q": "x"}), "unknown tool 'search'"),
        (call("calculator", {}), "missing arguments ['expression']"),
        (call("calculator", {"expression": "1", "extra": 2}), "unknown arguments ['extra']"),
        (call("calculator", {"expression": 5}), "must be string"),
        (call("boom", {"x": True}), "must be integer"),
        (call("boom", {"x": 1}), "tool exploded"),
        (call("calculator", {"expression": "__import__('os')"}), "not allowed"),
    ],
)
def test_bad_calls_become_error_observations(text, fragment):
    replies = run_tool_calls(text, TOOLS)
    assert replies is not None and len(replies) == 1
    assert replies[0]["role"] == "tool"
    assert replies[0]["content"].startswith("error: ") and fragment in replies[0]["content"]


def test_malformed_call_is_an_error_value_not_an_exception():
    (result,) = parse_tool_calls("<tool_call>{oops</tool_call>")
    assert isinstance(result, ToolCallError)


def test_tools_prompt_lists_schemas():
    prompt = tools_prompt([calculator_tool()])
    assert "<tools>" in prompt and '"name": "calculator"' in prompt and "<tool_call>" in prompt


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("1+2*3", 7),
        ("(1+2)*3", 9),
        ("-3**2", -9),
        ("2**-1", 0.5),
        ("7/2", 3.5),
        ("8/2", 4),
        ("17%5", 2),
        ("+-+4", -4),
        ("1.5*2", 3),
        ("2**100", 2**100),
    ],
)
def test_calculator_arithmetic(expr, value):
    assert safe_eval(expr) == value


@pytest.mark.parametrize(
    ("expr", "fragment"),
    [
        ("x + 1", "Name"),
        ("(1).real", "Attribute"),
        ("abs(-1)", "Call"),
        ("__import__('os').system('true')", "Call"),
        ("[1, 2]", "List"),
        ("'a' * 3", "Constant"),
        ("True + 1", "Constant"),
        ("1 < 2", "Compare"),
        ("lambda: 1", "Lambda"),
        ("1 // 2", "BinOp"),
        ("1 << 1000", "BinOp"),
        ("2 ** 10000", "too large"),
        ("10 ** 10 ** 10", "exponent too large"),
        ("9 ** 9 ** 9", "exponent too large"),
        ("2.0 ** 5000", "exponent too large"),
        ("(2**500) * (2**500)", "too large"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("1e400", "not finite"),
        ("1 +", "cannot parse"),
        ("1" + "+1" * 150, "at most"),
        ("(" * 40 + "1" + ")" * 40 + "+" + "-" * 40 + "1", "nested too deeply"),
    ],
)
def test_calculator_rejects(expr, fragment):
    with pytest.raises(CalculatorError, match=fragment.replace("(", r"\(")):
        safe_eval(expr)

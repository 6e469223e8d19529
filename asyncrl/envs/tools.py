"""Tool calls in the Qwen/Hermes format, Python tools with a JSON schema, and a safe calculator.

The model calls a tool by writing, anywhere in its turn,

    <tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>

`run_tool_calls` parses every call in a turn and answers each with one `tool` message. Nothing
the model writes can crash the rollout: malformed JSON, an unknown tool, arguments that break
the schema and an exception inside the tool all become an `error: ...` observation the model
can read and react to. The calculator evaluates by walking the AST (no `eval`).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.envs.base import Message

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


class ToolCallError(ValueError):
    """A tool call could not be parsed, resolved or validated (becomes an error observation)."""


@dataclass(frozen=True)
class Tool:
    """A Python callable the model may call; `parameters` is a JSON-schema object."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Qwen function schema (what a chat template's `tools=` takes)."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every `<tool_call>` block of `text`, in order; a malformed block yields its error."""
    out: list[ToolCall | ToolCallError] = []
    for body in TOOL_CALL.findall(text):
        out.append(_parse_one(body.strip()))
    closed = len(TOOL_CALL.findall(text))
    if text.count("<tool_call>") > closed:
        out.append(ToolCallError("unterminated <tool_call> (missing </tool_call>)"))
    return out


def _parse_one(body: str) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(body)
    except ValueError as e:
        return ToolCallError(f"tool call is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCallError('tool call must be {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return ToolCallError("tool call arguments are a string that is not JSON")
    if not isinstance(args, dict):
        return ToolCallError("tool call arguments must be a JSON object")
    return ToolCall(obj["name"], args)


def check_arguments(tool: Tool, args: Mapping[str, Any]) -> None:
    """Required keys present, no unknown keys, JSON types as the schema says."""
    props = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", []) if k not in args]
    unknown = [k for k in args if k not in props]
    if missing:
        raise ToolCallError(f"{tool.name}: missing arguments {missing}")
    if unknown:
        raise ToolCallError(f"{tool.name}: unknown arguments {unknown}")
    for key, value in args.items():
        types = _JSON_TYPES.get(props[key].get("type", ""), (object,))
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ToolCallError(f"{tool.name}: argument {key!r} must be {props[key]['type']}")


def call_tool(call: ToolCall | ToolCallError, tools: Mapping[str, Tool]) -> str:
    """The observation text for one call: the tool's result, or `error: ...`."""
    try:
        if isinstance(call, ToolCallError):
            raise call
        tool = tools.get(call.name)
        if tool is None:
            raise ToolCallError(f"unknown tool {call.name!r}; available: {', '.join(tools)}")
        check_arguments(tool, call.arguments)
        result = tool.fn(**call.arguments)
    except Exception as e:  # noqa: BLE001 - any tool failure is an observation, never a crash
        return f"error: {e}"[:300]
    return result if isinstance(result, str) else json.dumps(result)


def run_tool_calls(text: str, tools: Mapping[str, Tool]) -> list[Message] | None:
    """One `tool` message per call in `text`; None when the turn holds no tool call at all."""
    calls = parse_tool_calls(text)
    if not calls:
        return None
    return [{"role": "tool", "content": call_tool(c, tools)} for c in calls]


def tools_prompt(tools: Sequence[Tool]) -> str:
    """The Hermes system-prompt block that describes the tools and the call format."""
    schemas = "\n".join(json.dumps(t.schema()) for t in tools)
    return (
        "You may call one or more functions to assist with the user query.\n"
        f"<tools>\n{schemas}\n</tools>\n"
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
        '"arguments": <args-json-object>}\n</tool_call>'
    )


# -- the calculator ------------------------------------------------------------------------------
class CalculatorError(ValueError):
    """An expression the calculator refuses (not arithmetic, too large, division by zero)."""


MAX_EXPRESSION_CHARS = 200
MAX_BITS = 512  # |value| < 2**512 for every intermediate integer
MAX_DEPTH = 32
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
}


def safe_eval(expression: str) -> int | float:
    """Evaluate numbers, + - * / ** %, parentheses and unary minus/plus; anything else (names,
    attributes, calls, subscripts, comparisons) is refused, and so is any value too large."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression must be a string of at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r}") from None
    return _bounded(_eval(tree.body, 0))


def _eval(node: ast.AST, depth: int) -> int | float:
    if depth > MAX_DEPTH:
        raise CalculatorError("expression nested too deeply")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINOPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    raise CalculatorError(f"{type(node).__name__} is not allowed (numbers and + - * / ** % only)")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power before computing it when its size would pass the bound."""
    if abs(exponent) > 4 * MAX_BITS:
        raise CalculatorError("exponent too large")
    if abs(base) > 1 and exponent > 0 and exponent * math.log2(abs(base)) > MAX_BITS:
        raise CalculatorError("result too large")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):
        raise CalculatorError("complex result")
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) >= 2.0**MAX_BITS:
            raise CalculatorError("result too large or not finite")
        return int(value) if value.is_integer() and abs(value) < 2**53 else value
    if abs(value).bit_length() > MAX_BITS:
        raise CalculatorError("result too large")
    return value


def _calculator(expression: str) -> str:
    value = safe_eval(expression)
    return str(value if isinstance(value, int) else round(value, 10))


def calculator_tool() -> Tool:
    """`calculator(expression)`: arithmetic with + - * / ** % and parentheses."""
    params = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (12+3)*4"}},
        "required": ["expression"],
    }
    return Tool("calculator", "Evaluate an arithmetic expression.", params, _calculator)

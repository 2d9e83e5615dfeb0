"""The calculator task: two-digit multiplications the model cannot do in its head.

A task is a pair (a, b); the question "What is a * b?". The agent may call a `calculator`
tool; the reward is 1 when its final answer is exactly a * b, else 0 (verifiable). A 135M
model multiplies two-digit numbers by itself almost never, so the reward measures whether it
learned to call the tool with the right expression and to report what the tool said.
Training and validation pairs are disjoint (validation: a and b both odd).
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from typing import Any

TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
# Two worked examples the agent sends before each question (few-shot): how a call looks.
EXAMPLES = ((12, 34), (56, 21))
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}


def question(task: dict[str, Any]) -> str:
    return f"What is {task['a']} * {task['b']}?"


def messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation up to the question: the worked examples, then the task's question."""
    out: list[dict[str, Any]] = []
    for k, (a, b) in enumerate(EXAMPLES):
        call_id = f"call_example_{k}"
        out += [
            {"role": "user", "content": question({"a": a, "b": b})},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": "calculator",
                             "arguments": json.dumps({"expression": f"{a} * {b}"})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)},
        ]
    return out + [{"role": "user", "content": question(task)}]


def calculator(arguments: str) -> str:
    """The tool: evaluates `expression` (numbers, + - * / and parentheses), or says why not."""
    try:
        expression = json.loads(arguments).get("expression")
        value = _evaluate(ast.parse(str(expression), mode="eval").body)
    except (ValueError, SyntaxError, TypeError, AttributeError, ZeroDivisionError,
            RecursionError):
        return "error: give an expression such as 12 * 34"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if abs(node.value) > 10**12:
            raise ValueError("too large")
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ValueError("not arithmetic")


def reward(task: dict[str, Any], answer: str | None) -> float:
    """1 when the answer is the product (the number alone, or the first number it says)."""
    found = re.search(r"-?\d[\d,]*", answer or "")
    return 1.0 if found and found.group().replace(",", "") == str(task["a"] * task["b"]) \
        else 0.0


def make_dataset(size: int, *, seed: int, held_out: bool = False) -> list[dict[str, int]]:
    """`size` pairs of two-digit numbers; held out: both odd (never in training)."""
    rng = random.Random(seed)
    tasks: list[dict[str, int]] = []
    while len(tasks) < size:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if (a % 2 == 1 and b % 2 == 1) == held_out and (a, b) not in EXAMPLES:
            tasks.append({"a": a, "b": b})
    return tasks

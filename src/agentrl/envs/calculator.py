"""The calculator: the embedded default's one tool, as a plain function and as an environment class.

Below the tool loop (tools.py) and the environment registry, so that environments that offer the calculator
(reasoning-gym's arithmetic tasks) import it without importing the loop.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15  # any operand or intermediate value beyond this is an error, not a huge number
MAX_NODES = 64  # operators + numbers in one expression

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class ToolError(ValueError):
    """A tool refused its input; the message goes back to the policy as `error: <message>`."""


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ToolError("division by zero")
        value = _BINOPS[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_eval(node.operand))
    else:
        raise ToolError(f"unsupported element '{type(node).__name__}': only numbers, + - * / and parentheses")
    if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"value out of range (|x| <= {MAX_MAGNITUDE:.0e})")
    return value


def format_number(value: float) -> str:
    """7.0 -> '7', 2.5 -> '2.5', 1/3 -> '0.333333' (at most 6 decimals, no trailing zeros)."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses, e.g. "48/2" or "(3+4)*12".

    Returns:
        The value, e.g. "24".
    """
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = expression.replace(",", "").replace("$", "").strip()
    if not text:
        raise ToolError("empty expression")
    if "**" in text or "//" in text:
        raise ToolError("unsupported operator: only + - * / and parentheses")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError(f"not an arithmetic expression: {text[:40]!r}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES * 2:
        raise ToolError(f"expression has more than {MAX_NODES} numbers and operators")
    return format_number(_eval(tree))


class Calculator:
    """The calculator as an environment in TRL's `environment_factory` shape: stateless, one tool. It is what
    `agent.tools: [calculator]` runs (the embedded default)."""

    def reset(self, **row) -> None:
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: numbers with + - * / and parentheses, e.g. "48/2" or "(3+4)*12".

        Returns:
            The value, e.g. "24".
        """
        try:
            return calculator(expression)
        except ToolError as e:  # answered, not raised: TRL's loop would render a raise as "{'error': ...}"
            return f"error: {str(e)[:120]}"

"""Bring your own environment, form 1: a Python class (run it: `python examples/environments/tape_calculator.py`).

An environment is a class in the shape of TRL's `GRPOTrainer(environment_factory=...)`: `reset(**row)` starts an
episode from one dataset row, and every public method with type hints and a Google docstring is a tool the policy
can call. One instance plays one episode. This one is a calculator with a tape: it remembers its results, and an
expression may use `ans` (the last result), state a stateless tool function could not keep.

Train on it (the embedded default's problems; the demonstrations' `<<48/2=24>>` calls are replayed through it):

    python scripts/recipe.py run examples/environments/tape-calculator.yaml -- --temp --name tape-calculator

The class needs nothing from agentrl: the stages import it by the path in `agent.environment`
(`examples.environments.tape_calculator:TapeCalculator`), from the repository root, where the stages run.
"""

from __future__ import annotations

import ast
import operator
from typing import Optional

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class TapeCalculator:
    """A calculator that keeps its results on a tape; `ans` in an expression is the last one."""

    def __init__(self, max_tape: int = 32):
        self.max_tape = max_tape  # knobs come from params: environments.<name>.* (none needed here)
        self.tape: list[float] = []

    def reset(self, **row) -> Optional[str]:
        """A fresh tape for each episode; the row (question, ground_truth, ...) is not needed here."""
        self.tape = []
        return None  # no observation: the prompt is the row's question

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression; `ans` is the previous result.

        Args:
            expression: numbers with + - * / and parentheses, e.g. "48/2" or "ans*3".

        Returns:
            The value, e.g. "24", or "error: ..." when the expression cannot be evaluated.
        """
        if len(self.tape) >= self.max_tape:
            return "error: the tape is full"
        try:
            value = self._evaluate(ast.parse(expression.replace(",", "").strip(), mode="eval").body)
        except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
            return f"error: {e}"  # answered, not raised: the policy reads the error and may retry
        self.tape.append(value)
        return str(int(value)) if float(value).is_integer() else f"{value:.6f}".rstrip("0").rstrip(".")

    def _evaluate(self, node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.Name) and node.id == "ans":
            if not self.tape:
                raise ValueError("no previous result for ans")
            return self.tape[-1]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self._evaluate(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](self._evaluate(node.left), self._evaluate(node.right))
        raise ValueError(f"unsupported: {type(node).__name__} (numbers, + - * /, parentheses and ans only)")


if __name__ == "__main__":
    # What the project checks before it trains on a class (tools typed, docstrings TRL can render), then one episode.
    from agentrl.envs.contract import check_environment_class

    check_environment_class(TapeCalculator)
    env = TapeCalculator()
    env.reset(question="A box holds 48 pens shared by 2 pupils, then each buys 3 times as many.", ground_truth="72")
    print("48/2 ->", env.calculate("48/2"), "| ans*3 ->", env.calculate("ans*3"), "| 1/0 ->", env.calculate("1/0"))

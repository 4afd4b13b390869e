"""Tools the policy can call, and the two ways a call is written in text (tool-call formats).

A tool is a plain Python function `f(expression: str) -> str` (type hints and a Google-style docstring,
so TRL's native `GRPOTrainer(tools=[...])` can describe it too). `agent.tools` names them: a registry
name (`calculator`) or a custom `module:function`, like the rewards. A tool never raises into the
generation loop: `call_tool` turns every failure into an `error: ...` string for the policy and counts it.

Formats (`agent.format`):
  inline  GSM8K's calculator annotation: the policy writes `<<48/2=`, the loop appends `24>>` (tokens
          never sampled) and the policy continues. One tool (the first in agent.tools) serves it.
  chat    Qwen3-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` ends the
          assistant turn; the result comes back as a `<tool_response>` turn and the policy continues.
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import operator
import re
from dataclasses import dataclass
from typing import Callable, Optional

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


REGISTRY: dict[str, Callable[..., str]] = {"calculator": calculator}


def get_tool(name: str) -> Callable[..., str]:
    """A tool by registry name or `module:function` import path."""
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"agent.tools: cannot import custom tool '{name}': {e}") from None
        if not callable(fn):
            raise ValueError(f"agent.tools: '{name}' is not callable")
        return fn
    raise ValueError(
        f"agent.tools: unknown tool '{name}'; known: {', '.join(sorted(REGISTRY))} "
        "(or a custom one as 'module:function')"
    )


def call_tool(fn: Callable[..., str], *args, **kwargs) -> tuple[str, bool]:
    """(result text, ok). Any exception becomes 'error: ...' (ok False); never raises."""
    try:
        out = fn(*args, **kwargs)
        return str(out), True
    except Exception as e:  # a tool's failure is data for the policy, not a crash
        msg = str(e) if isinstance(e, ToolError) else f"{type(e).__name__}: {e}"
        return f"error: {msg[:120]}", False


# ----------------------------------------------------------------------------------- formats
@dataclass
class Call:
    """One tool call found in the policy's text: which tool, its arguments, the text that opened it."""

    name: str
    arguments: dict


class InlineFormat:
    """`<<expr=` opens a calculator call; the loop appends `result>>`."""

    name = "inline"
    trigger = "="  # a call can only be complete after a token containing this

    def open_call(self, text: str, at_eos: bool = False) -> Optional[Call]:
        if at_eos:
            return None
        start = text.rfind("<<")
        if start < 0 or text.rfind(">>") > start:
            return None
        inside = text[start + 2 :]
        if "=" not in inside:
            return None
        return Call("", {"expression": inside[: inside.index("=")]})

    def render_result(self, result: str) -> str:
        return f"{result}>>"

    def render_call(self, call: Call) -> str:
        return f"<<{call.arguments['expression']}="


class ChatFormat:
    """Qwen3's tool-call turns: the policy ends its turn after `</tool_call>`; the tool's result comes
    back in a user turn `<tool_response>...</tool_response>` (Qwen3's chat template renders tool
    messages this way) and a new assistant turn starts."""

    name = "chat"
    trigger = ">"

    def __init__(self, eos_token: str = "<|im_end|>"):
        self.eos_token = eos_token

    def open_call(self, text: str, at_eos: bool = False) -> Optional[Call]:
        t = text.rstrip()
        if not at_eos or not t.endswith("</tool_call>") or "<tool_call>" not in t:
            return None
        body = t[t.rfind("<tool_call>") + len("<tool_call>") : -len("</tool_call>")].strip()
        try:
            payload = json.loads(body)
            name, arguments = payload["name"], payload.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError("name must be a string and arguments an object")
        except (ValueError, KeyError, TypeError) as e:
            return Call("<invalid>", {"error": f"invalid tool call: {e}"})
        return Call(name, arguments)

    def render_result(self, result: str) -> str:
        return (
            f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response>{self.eos_token}\n<|im_start|>assistant\n"
        )

    def render_call(self, call: Call) -> str:
        body = json.dumps({"name": call.name or "calculator", "arguments": call.arguments})
        return f"<tool_call>\n{body}\n</tool_call>"


class Toolset:
    """The tools of one run and their format: runs a `Call`, returns (result text, ok)."""

    def __init__(
        self,
        names: list[str],
        fmt: str = "inline",
        max_calls: int = 8,
        max_expression_chars: int = MAX_EXPRESSION_CHARS,
        eos_token: str = "<|im_end|>",
    ):
        if not names:
            raise ValueError("agent.tools is empty: there is no tool to call")
        self.names = list(names)
        self.tools = {n.rpartition(":")[2]: get_tool(n) for n in names}
        self.format = InlineFormat() if fmt == "inline" else ChatFormat(eos_token)
        self.max_calls = max_calls
        self.max_expression_chars = max_expression_chars

    def chat_template_kwargs(self) -> dict:
        """Arguments for `apply_chat_template`: the chat format describes the tools in the prompt (as TRL's
        GRPOTrainer(tools=...) renders it); the inline format needs nothing."""
        return {"tools": list(self.tools.values())} if self.format.name == "chat" else {}

    def run(self, call: Call) -> tuple[str, bool]:
        if "error" in call.arguments and call.name == "<invalid>":
            return f"error: {call.arguments['error'][:120]}", False
        fn = self.tools.get(call.name) if call.name else next(iter(self.tools.values()))
        if fn is None:
            return f"error: unknown tool '{call.name[:40]}'; available: {', '.join(self.tools)}", False
        expr = call.arguments.get("expression")
        if isinstance(expr, str) and len(expr) > self.max_expression_chars:
            return f"error: expression longer than {self.max_expression_chars} characters", False
        return call_tool(fn, **call.arguments)


def toolset_from_params(agent, eos_token: str = "<|im_end|>") -> Optional[Toolset]:
    """The Toolset that `agent.*` params describe, or None when agent.tools is empty."""
    if not agent.tools:
        return None
    return Toolset(list(agent.tools), agent.format, agent.max_tool_calls, agent.max_expression_chars, eos_token)


# --------------------------------------------------------------------- traces in training data
_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


def split_annotated(text: str, fmt: str = "inline", eos_token: str = "<|im_end|>") -> list[tuple[str, bool]]:
    """A worked solution with GSM8K annotations -> segments (text, is_model_text), exactly as the tool
    loop produces them: the policy writes `<<48/2=`, the tool writes `24>>`.

    '48/2=<<48/2=24>>24 clips' -> [('48/2=<<48/2=', True), ('24>>', False), ('24 clips', True)].
    The tool's part is what the calculator returns for the expression (not the annotation's own
    text); an annotation it cannot evaluate is dropped (the policy writes that step itself). For the
    chat format each call becomes a `<tool_call>` that ends the turn and a `<tool_response>` turn."""
    segments: list[tuple[str, bool]] = []
    pos = 0
    f = InlineFormat() if fmt == "inline" else ChatFormat(eos_token)
    end_turn = eos_token if fmt == "chat" else ""
    pending = ""
    for m in _ANNOTATION.finditer(text):
        result, ok = call_tool(calculator, m.group(1))
        if not ok:  # an annotation the calculator cannot evaluate: the policy writes that step itself
            pending += text[pos : m.start()]
            pos = m.end()
            continue
        call = Call("calculator", {"expression": m.group(1)})
        segments.append((pending + text[pos : m.start()] + f.render_call(call) + end_turn, True))
        segments.append((f.render_result(result), False))
        pending, pos = "", m.end()
    segments.append((pending + text[pos:], True))
    return segments

"""Client-side function calling for `/v1/chat/completions` (OpenAI's `tools`): the request models, how a
request's tools and its tool-call history become the policy's prompt, and how the policy's call becomes
`tool_calls` in the reply.

The policy writes calls in its own format (`agent.format`, agentrl/tools.py); this module maps that format to
OpenAI's:

  inline  (the embedded default, GSM8K's calculator syntax) The request declares one function with one
          string parameter (any name: `calculator(expression)`, `calc(expr)`). When the policy writes
          `<<48/2=`, generation stops and the reply is `content: "...48/2="`, `tool_calls: [{function:
          {name, arguments: '{"expression": "48/2"}'}}]`, finish_reason `tool_calls`. The client's `tool`
          message comes back as the tool part of the annotation, `24>>`, and the same assistant turn goes on:
          exactly the text the server-side loop would have built. The function's description is not shown to
          this policy (it was trained on the syntax alone).
  chat    (Qwen3-style hub models) The request's tools go to the chat template (`tools=`), which describes them
          to the policy; `<tool_call>{"name", "arguments"}</tool_call>` blocks in its turn become `tool_calls`;
          assistant `tool_calls` and `tool` messages in the history are rendered by the template.

`tool_choice`: `auto` (default), `none` (no call is parsed; the prompt still lists the tools), `required` or
`{"type": "function", "function": {"name": ...}}`: the assistant turn is started with the format's call opener
(`<<`; `<tool_call>` plus the name), so the policy's reply is that call. A call that does not parse (bad JSON,
unknown function) comes back as plain content with finish_reason `stop`, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from ..agent.tools import InlineFormat

MAX_TOOLS = 128  # as OpenAI
MAX_TOOLS_JSON = 64 * 1024  # characters of all tools' JSON together (the prompt of a chat-format policy)
MAX_SCHEMA_DEPTH = 16  # nesting of a function's `parameters` (objects and arrays)
MAX_SCHEMA_NODES = 2000  # objects, arrays and values in one function's `parameters`
MAX_DESCRIPTION = 4096
MAX_ARGUMENTS_CHARS = 32 * 1024  # one tool call's `arguments` (a JSON object as a string), client's or model's
MAX_ARGUMENTS_DEPTH = 16  # nesting of those arguments (objects and arrays), as MAX_SCHEMA_DEPTH
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # as OpenAI
CALL_OPENERS = {"inline": "<<", "chat": "<tool_call>\n"}


# ----------------------------------------------------------------------------- request models
def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"invalid Unicode: lone surrogate at character {error.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


class Body(BaseModel):
    """Strict request bodies: no coercion (`"1"` is not a number), no NaN/Infinity, no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _check_schema(schema: dict) -> dict:
    """A function's `parameters`: a JSON schema of type object, bounded in depth, size and valid Unicode.
    Walked with an explicit stack (a hostile depth never reaches Python's recursion limit)."""
    if schema.get("type", "object") != "object":
        raise ValueError(f"must be a JSON schema of type 'object', got type {_short(schema.get('type'))}")
    stack, nodes = [(schema, 1)], 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
        if nodes > MAX_SCHEMA_NODES:
            raise ValueError(f"more than {MAX_SCHEMA_NODES} values")
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if isinstance(key, str):
                _valid_unicode(key)
            if isinstance(value, str):
                _valid_unicode(value)
            elif isinstance(value, float) and value != value:  # NaN cannot be rendered as JSON
                raise ValueError("contains NaN")
            elif isinstance(value, (dict, list)):
                stack.append((value, depth + 1))
    return schema


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:40] + "..."


class FunctionDef(Body):
    """A function the client offers (OpenAI's `tools[].function`)."""

    name: Annotated[Text, Field(pattern=FUNCTION_NAME)]
    description: Optional[Annotated[Text, Field(max_length=MAX_DESCRIPTION)]] = None
    parameters: Optional[Annotated[dict[str, Any], AfterValidator(_check_schema)]] = None
    strict: Optional[bool] = None

    def properties(self) -> dict:
        props = (self.parameters or {}).get("properties") or {}
        return props if isinstance(props, dict) else {}


class ToolDef(Body):
    """One entry of a request's `tools`."""

    type: Literal["function"]
    function: FunctionDef


def _tools_size(tools: list[ToolDef]) -> list[ToolDef]:
    names = [t.function.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"function {dup!r} is declared twice")
    size = len(json.dumps([t.model_dump(exclude_none=True) for t in tools], ensure_ascii=False))
    if size > MAX_TOOLS_JSON:
        raise ValueError(f"the tools' JSON is {size} characters; at most {MAX_TOOLS_JSON}")
    return tools


Tools = Annotated[list[ToolDef], Field(min_length=1, max_length=MAX_TOOLS), AfterValidator(_tools_size)]


class FunctionName(Body):
    """The function `tool_choice` names."""

    name: Text


class NamedToolChoice(Body):
    """`tool_choice` naming one function."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class CallFunction(Body):
    """A call's function and its JSON arguments."""

    name: Text
    arguments: Text  # a JSON object, as a string (OpenAI's shape)


class MessageToolCall(Body):
    """One call in an assistant message's `tool_calls`."""

    id: Annotated[Text, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: CallFunction


# ------------------------------------------------------------------------------------- errors
class ToolRequestError(ValueError):
    """A request that cannot be served as asked; `param` names the field (app.py renders it as a 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param, self.message = param, message


# ------------------------------------------------------------------------------- bounded JSON
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(raw: str) -> int:
    """How deeply `raw` nests objects and arrays (brackets inside strings do not count), in one linear pass, so
    a hostile depth is measured before `json.loads` recurses into it (RecursionError)."""
    depth = deepest = 0
    for bracket in _JSON_BRACKET.finditer(_JSON_STRING.sub('""', raw)):
        depth += 1 if bracket.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def load_bounded_json(
    raw: str, param: str, max_chars: int = MAX_ARGUMENTS_CHARS, max_depth: int = MAX_ARGUMENTS_DEPTH
) -> Any:
    """`raw` parsed as JSON, bounded before any parsing: at most `max_chars` characters and `max_depth` levels of
    nesting; its strings must be valid Unicode (an escaped lone surrogate, `"\\ud800"`, decodes to a string no
    tokenizer can encode).

    Args:
        raw: the JSON text (a client's tool-call arguments, or the policy's call).
        param: the request field it came from, named in the error.
        max_chars: the longest text accepted.
        max_depth: the deepest nesting accepted.

    Returns:
        The parsed value. Raises ToolRequestError (param, what was expected) for anything else."""
    if len(raw) > max_chars:
        raise ToolRequestError(param, f"is {len(raw)} characters; at most {max_chars}")
    depth = json_depth(raw)
    if depth > max_depth:
        raise ToolRequestError(param, f"nests {depth} levels deep; at most {max_depth}")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        raise ToolRequestError(param, "must be a JSON object (as a string): not valid JSON") from None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        raise ToolRequestError(param, f"invalid Unicode: a lone surrogate escape at character {error.start}") from None
    return value


# --------------------------------------------------------------------------------------- plan
@dataclass
class ToolPlan:
    """How one request's tools are served: the policy's format, the declared functions, the choice."""

    fmt: str  # inline | chat
    functions: dict[str, FunctionDef]
    choice: str  # auto | none | required | named
    forced: Optional[str] = None  # the function tool_choice names
    parallel: bool = True
    inline_function: Optional[str] = None  # inline: the one function the policy's `<<expr=` calls
    inline_argument: Optional[str] = None  # ... and its one string parameter

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    @property
    def prefix(self) -> str:
        """Text the assistant turn starts with: the call opener when a call is required."""
        if self.choice not in ("required", "named"):
            return ""
        if self.fmt == "chat" and self.forced:
            return f'{CALL_OPENERS["chat"]}{{"name": "{self.forced}", "arguments": '
        return CALL_OPENERS[self.fmt]

    def template_tools(self) -> list[dict]:
        """The tools as the chat template takes them (OpenAI's JSON shape); the inline format shows none."""
        if self.fmt != "chat":
            return []
        return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions.values()]


def plan_tools(
    fmt: str, tools: Optional[list[ToolDef]], tool_choice: Optional[ToolChoice], parallel: Optional[bool]
) -> Optional[ToolPlan]:
    """The plan for a request's `tools`/`tool_choice`, or None when it has no tools (the server-side loop)."""
    if tools is None:
        if tool_choice is not None:
            raise ToolRequestError("tool_choice", "only allowed when tools are given")
        if parallel is not None:
            raise ToolRequestError("parallel_tool_calls", "only allowed when tools are given")
        return None
    functions = {t.function.name: t.function for t in tools}
    forced = None
    if isinstance(tool_choice, NamedToolChoice):
        forced = tool_choice.function.name
        if forced not in functions:
            raise ToolRequestError(
                "tool_choice.function.name", f"{forced[:64]!r} is not among the declared tools: {', '.join(functions)}"
            )
        choice = "named"
    else:
        choice = tool_choice or "auto"
    plan = ToolPlan(fmt, functions, choice, forced, parallel is not False)
    if fmt == "inline":
        candidates = [forced] if forced else list(functions)
        if len(candidates) != 1:
            raise ToolRequestError(
                "tools",
                f"this model writes calls in the inline calculator syntax, which calls one function; the request "
                f"declares {len(candidates)} ({', '.join(candidates)[:200]}): declare one, or name one in tool_choice",
            )
        name = candidates[0]
        props = functions[name].properties()
        strings = [k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"]
        if len(props) != 1 or len(strings) != 1:
            position = list(functions).index(name)
            raise ToolRequestError(
                f"tools.{position}.function.parameters",
                f"function {name!r}: the inline calculator syntax passes one string argument, so its parameters "
                f"must have exactly one property, of type string (e.g. {{'expression': {{'type': 'string'}}}})",
            )
        plan.inline_function, plan.inline_argument = name, strings[0]
    return plan


# ------------------------------------------------------------------------------ conversation
def _args(raw: str, param: str) -> dict:
    args = load_bounded_json(raw, param)
    if not isinstance(args, dict):
        raise ToolRequestError(param, f"must be a JSON object, got {type(args).__name__}")
    return args


class _ConversationRenderer:
    """render_conversation's state, message by message: the messages for the chat template so far, the calls of
    the latest assistant message and their results, and (inline format) the assistant turn being built."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.out: list[dict] = []
        self.pending: dict[str, Optional[str]] = {}  # call id -> its result (None until a tool message answers it)
        self.order: list[tuple[str, str]] = []  # inline: (call id, expression) of the latest assistant message
        self.turn: Optional[list[tuple[str, bool]]] = None  # inline: segments of the assistant turn being built

    def close_turn(self) -> None:
        """End the inline assistant turn being built, as one assistant message."""
        if self.turn is not None:
            self.out.append({"role": "assistant", "content": "".join(text for text, _ in self.turn)})
            self.turn = None

    def check_answered(self, where: str) -> None:
        """Raise (naming `where`) when a call of the latest assistant message has no tool message answering it."""
        missing = [call for call, result in self.pending.items() if result is None]
        if missing:
            raise ToolRequestError(where, f"the tool call {missing[0][:64]!r} is not answered by a tool message")

    def add_tool_result(self, index: int, message: dict) -> None:
        """A tool message: the result of one pending call (inline: once all are in, they join the turn in order)."""
        cid = message.get("tool_call_id")
        where = f"messages.{index}.tool_call_id"
        if cid is None:
            raise ToolRequestError(where, "required in a tool message")
        if cid not in self.pending:
            raise ToolRequestError(where, f"{cid[:64]!r} answers no tool call of the assistant message before it")
        if self.pending[cid] is not None:
            raise ToolRequestError(where, f"{cid[:64]!r} is answered twice")
        self.pending[cid] = message["content"]
        if self.fmt == "chat":
            self.out.append({"role": "tool", "content": message["content"]})
        elif all(self.pending[call] is not None for call, _ in self.order):  # results in the order of the calls
            for call, expression in self.order:
                self.turn += [(f"<<{expression}=", True), (f"{self.pending[call]}>>", False)]

    def add_message(self, index: int, message: dict, previous_role: Optional[str]) -> None:
        """Any message but a tool result: the calls before it must all be answered."""
        role, calls = message["role"], message.get("tool_calls") or []
        self.check_answered(f"messages.{index}")
        continues = self.fmt == "inline" and role == "assistant" and self.turn is not None and previous_role == "tool"
        self.pending, self.order = {}, []
        if not continues:
            self.close_turn()
        if role != "assistant":
            self.out.append({"role": role, "content": message["content"]})
            return
        for position, call in enumerate(calls):
            if call["id"] in self.pending:
                raise ToolRequestError(
                    f"messages.{index}.tool_calls.{position}.id", f"{call['id'][:64]!r} is used twice"
                )
            self.pending[call["id"]] = None
        if self.fmt == "chat":
            self._add_chat_assistant(index, message, calls)
        else:
            self._add_inline_assistant(index, message, calls)

    def _add_chat_assistant(self, index: int, message: dict, calls: list[dict]) -> None:
        """chat format: the calls go to the template, their arguments as objects."""
        where = f"messages.{index}.tool_calls"
        assistant: dict = {"role": "assistant", "content": message["content"]}
        if calls:
            assistant["tool_calls"] = [
                {
                    "type": "function",
                    "function": {
                        "name": call["function"]["name"],
                        "arguments": _args(call["function"]["arguments"], f"{where}.{position}.function.arguments"),
                    },
                }
                for position, call in enumerate(calls)
            ]
        self.out.append(assistant)

    def _add_inline_assistant(self, index: int, message: dict, calls: list[dict]) -> None:
        """inline format: the content joins the turn; each call's one string argument waits for its result."""
        where = f"messages.{index}.tool_calls"
        self.turn = (self.turn or []) + [(message["content"], True)]
        for position, call in enumerate(calls):
            values = list(_args(call["function"]["arguments"], f"{where}.{position}.function.arguments").values())
            if len(values) != 1 or not isinstance(values[0], str):
                raise ToolRequestError(
                    f"{where}.{position}.function.arguments",
                    "this model's inline calculator syntax takes one string argument",
                )
            self.order.append((call["id"], values[0]))
        if not calls:
            self.close_turn()


def render_conversation(messages: list[dict], fmt: str) -> tuple[list[dict], list[tuple[str, bool]]]:
    """(messages for the chat template, continuation) for a conversation that may hold tool calls.

    messages: {role, content (str), tool_calls (list of MessageToolCall dicts) or None, tool_call_id}. Every
    tool message must answer a call of the assistant message before it, and every call must be answered
    before the next other message (errors name the message). chat format: the calls go to the template
    (arguments as objects). inline format: an assistant message, its calls and their results become one
    assistant turn, `content<<args=result>>...`, continued by an assistant message right after the results;
    when the conversation ends inside that turn (its last message is a tool result) the turn is left open as
    `continuation`: (text, is_model_text) segments the policy continues, tokenized piece by piece as the
    server-side loop builds them.

    Args:
        messages: the request's messages, as dicts.
        fmt: the policy's call format, inline or chat.

    Returns:
        (messages for the chat template, continuation segments; empty unless an inline turn is left open).
    """
    renderer = _ConversationRenderer(fmt)
    for index, message in enumerate(messages):
        if message["role"] == "tool":
            renderer.add_tool_result(index, message)
        else:
            renderer.add_message(index, message, messages[index - 1]["role"] if index else None)
    renderer.check_answered(f"messages.{len(messages) - 1}")
    if renderer.turn is not None:  # the conversation ends with tool results: the policy continues its turn
        return renderer.out, _merge(renderer.turn)
    return renderer.out, []


def _merge(segments: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []
    for text, model in segments:
        if not text:
            continue
        if out and out[-1][1] == model:
            out[-1] = (out[-1][0] + text, model)
        else:
            out.append((text, model))
    return out


# ---------------------------------------------------------------------------------- parsing
_CHAT_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def call_id() -> str:
    """A fresh call id in OpenAI's shape (`call_...`)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def open_inline_call(text: str) -> Optional[str]:
    """The expression of the inline call `text` ends with (`...<<48/2=`), else None."""
    call = InlineFormat().open_call(text)
    return None if call is None else call.arguments["expression"]


_INLINE_CALL = re.compile(r"<<([^<>=]*)=")


def inline_call_end(text: str) -> Optional[int]:
    """Where the first inline call of a completion closes (the index just after its `=`), else None.

    The first `<<expr=`, not the last `<<`: a merged token such as `=<<` closes one call and opens the next in
    one step (`<<21-10` + `=<<`), so checking only whether the text *ends* with an open call misses it, and a
    forced opener (tool_choice required/named) then came back as content (`<<21-10=`) next to a later call.

    Args:
        text: the assistant turn generated so far, the forced opener (ToolPlan.prefix) included.

    Returns:
        The end of the call's `=`, or None while no call is closed."""
    call = _INLINE_CALL.search(text)
    return None if call is None else call.end()


def safe_prefix(text: str, plan: ToolPlan) -> str:
    """The part of `text` (generated so far) that is content whatever comes next: streaming holds back a
    possible call opener, so content deltas never contain what becomes a tool call."""
    if not plan.parses_calls:
        return text
    if plan.fmt == "inline":
        at = text.rfind("<<")
        if at >= 0 and text.rfind(">>") < at:
            return text[:at]
        return text[:-1] if text.endswith("<") else text
    at = text.find("<tool_call>")
    if at >= 0:
        return text[:at]
    opener = "<tool_call>"
    for length in range(len(opener) - 1, 0, -1):
        if text.endswith(opener[:length]):
            return text[:-length]
    return text


def parse_calls(text: str, plan: ToolPlan, called: bool) -> tuple[Optional[str], list[dict]]:
    """(content, tool_calls) of a finished completion. `called`: generation stopped at an inline call."""
    if not plan.parses_calls:
        return text, []
    if plan.fmt == "inline":
        expr = open_inline_call(text) if called else None
        if expr is None:
            return text, []
        content = text[: text.rfind("<<")]
        args = json.dumps({plan.inline_argument: expr}, ensure_ascii=False)
        return content or None, [_call(plan.inline_function, args)]
    blocks = list(_CHAT_CALL.finditer(text))
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        try:  # the policy's text is bounded like a client's: a runaway nesting is no call, never a 500
            payload = load_bounded_json(block.group(1), "tool_call")
            name, args = payload["name"], payload.get("arguments", {})
            if isinstance(args, str):
                args = load_bounded_json(args, "tool_call.arguments")
        except (ToolRequestError, KeyError, TypeError, AttributeError):
            return text, []  # not a call: the text is the content, as OpenAI-compatible servers return it
        if not isinstance(name, str) or name not in plan.functions or not isinstance(args, dict):
            return text, []
        if plan.forced and name != plan.forced:
            return text, []
        calls.append(_call(name, json.dumps(args, ensure_ascii=False)))
    if not plan.parallel:
        calls = calls[:1]
    content = text[: blocks[0].start()].strip()
    return content or None, calls


def _call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def control_token_in(value: Any, protocol: list[str]) -> Optional[str]:
    """The first protocol token spelled inside a JSON-like value (tools and call arguments that a chat template
    renders as its own text, where a protocol token would be one), else None.

    Args:
        value: what the template renders (the tools, an assistant message's tool calls).
        protocol: the tokenizer's added tokens, special or not (engine.protocol_tokens): Qwen3's `<tool_call>`
            and `</tool_response>` are non-special, yet tokenize as protocol tokens wherever they are spelled.

    Returns:
        The token's text, or None."""
    text = json.dumps(value, ensure_ascii=False)
    return next((t for t in protocol if t in text), None)

"""An environment served over OpenEnv (agentrl.serving.openenv_server) as a class in TRL's `environment_factory` shape
(issue 42).

`remote_environment_class(url)` asks the server for its tools (openenv-core's `GenericEnvClient`) and returns a class
with `reset(**row)`, one method per server tool with the tool's real signature and docstring (so TRL's
GRPOTrainer(environment_factory=...) and our loop render and call the same tools as in-process) and `get_reward()`
when the served environment has one. Each instance is one OpenEnv session (one WebSocket), opened at its first reset
and reused by later resets (TRL pools its instances).

Any OpenEnv server, in one of three kinds (`describe` tells them apart, in this order):

  agentrl  ours (agentrl.serving.openenv_server): its `state` lists the tools with their signatures and docstrings;
           the run's agent.environment is the one it serves, and "solved" is that environment's rule (judged there)
  mcp      it answers OpenEnv's `list_tools` action (an MCPEnvironment, e.g. OpenEnv's echo_env): each listed tool
           becomes a method, its parameters from the tool's JSON input schema, called with `call_tool`
  actions  its step takes a typed action (e.g. a grid world's `{"action": "UP"}`): the action's JSON schema (GET
           /schema) becomes one tool, `act`, whose arguments are the action's fields and whose answer is the
           observation

The last two are "foreign" (agent.environment: openenv): the run trains on whatever the server serves, with its reward
(an episode is solved when the server's reward reaches 1) and the data params give (data.source).

Nothing hangs: connecting and every message have a timeout. A server that refuses, hangs or answers malformed JSON
is an `OpenEnvError` naming the URL when the class is made (the stage's start) and at reset; mid-episode a tool
answers `error: openenv server <url>: ...` and the episode's session is dropped.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import inspect
import json
import keyword
import math
import select
import subprocess
import sys
import threading
import typing
from typing import Any, Optional

from .contract import EnvironmentLost, not_a_tool

MAX_ANNOTATION_CHARS = 200  # a served annotation is parsed: a bound keeps a hostile one from exhausting the parser
JUDGE_TOOL = "_episode_solved"  # the server's action that answers "solved" by the environment's own rule
FOREIGN = "openenv"  # agent.environment for a server that is not ours: whatever it serves
ACT_TOOL = "act"  # a typed-action server's one tool: the step action's fields as its arguments
REQUEST_KEY = "agentrl_request"  # a call's number in its action's metadata; our server echoes it as `request`
MAX_SCHEMA_BYTES = 1 << 20  # GET /schema: a bigger answer is refused
# JSON schema types as the annotations a served tool may use (_TYPE_NAMES); anything else is left as Any
_JSON_TYPES = {
    "string": "str",
    "integer": "int",
    "number": "float",
    "boolean": "bool",
    "array": "list",
    "object": "dict",
}
MAX_MESSAGE_BYTES = 1 << 20  # one WebSocket message (a reset row, a step): uvicorn refuses bigger ones
STARTUP_TIMEOUT_S = 60.0  # `serve`: the server subprocess must print its URL within this

# the names a served tool's annotation may use (parsed, never evaluated: the server's text is data)
_TYPE_NAMES: dict[str, Any] = {
    "str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict, "tuple": tuple,
    "None": None, "Any": typing.Any, "Optional": typing.Optional, "Union": typing.Union, "Literal": typing.Literal,
    "List": typing.List, "Dict": typing.Dict, "Tuple": typing.Tuple,
}  # fmt: skip


class OpenEnvError(RuntimeError):
    """An OpenEnv server could not be reached or answered something unusable; the message names its URL."""


class ServerRefused(OpenEnvError):
    """The server answered a call with an error message (a bad action, a row its reset refused, no free session):
    its reason is in the message, and the session stays open."""


_LOOP: list = []  # one event loop thread for every client of this process (not one thread per episode)
_LOOP_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    with _LOOP_LOCK:
        if not _LOOP:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True, name="openenv-client").start()
            _LOOP.append(loop)
        return _LOOP[0]


def _run(coro, timeout_s: float):
    """The coroutine's result, run on the shared loop.

    Args:
        coro: the coroutine.
        timeout_s: the deadline; past it the coroutine is cancelled and TimeoutError raised.

    Returns:
        What the coroutine returned.
    """
    loop = _loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:  # waiting here would block the very loop the coroutine needs
        coro.close()
        raise RuntimeError("agentrl.envs.openenv_client: _run called on the client loop's own thread (a deadlock)")
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"no answer within {timeout_s:g} s") from None


def _why(error: BaseException) -> str:
    if isinstance(error, json.JSONDecodeError):
        return f"answered malformed JSON ({error})"
    if isinstance(error, (TimeoutError, asyncio.TimeoutError)):
        return f"no answer within the timeout ({error or 'timed out'})"
    return f"{type(error).__name__}: {error}"


def finite_reward(reward, where: str) -> Optional[float]:
    """A served reward as a float, or None when the server sent none; NaN, infinities and non-numbers are refused
    (OpenEnvError): one NaN would make every advantage of its group NaN."""
    if reward is None:
        return None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise OpenEnvError(f"{where}: reward {str(reward)[:40]!r} is not a finite number")
    return float(reward)


class Session:
    """One OpenEnv WebSocket session through openenv-core's GenericEnvClient, with a deadline on every call."""

    def __init__(self, url: str, timeout_s: float):
        from openenv.core import GenericEnvClient

        self.url, self.timeout_s = url, timeout_s
        self.client = GenericEnvClient(
            base_url=url,
            connect_timeout_s=timeout_s,
            message_timeout_s=timeout_s,
            max_message_size_mb=MAX_MESSAGE_BYTES / 2**20,
        )

    def call(self, what: str, coro_fn, *args, **kwargs):
        """`await coro_fn(*args, **kwargs)` after connecting; any failure closes the session.

        Args:
            what: the stage of the episode, for the error ("reset", "tool 'check'").
            coro_fn: a coroutine method of the GenericEnvClient (reset, step, state).

        Returns:
            What it returned; OpenEnvError naming the URL and `what` on any failure.
        """

        async def connected():
            await self.client.connect()
            try:
                return await coro_fn(*args, **kwargs)
            except Exception:
                await self._raise_parting_error()  # the server's reason, when it sent one before closing
                raise

        try:  # connect + one message, each with its own timeout inside; this deadline covers both
            return _run(connected(), 2 * self.timeout_s + 1)
        except RuntimeError as e:
            if str(e).startswith("Server error:"):  # GenericEnvClient: the server answered {"type": "error"}
                raise ServerRefused(
                    f"openenv server {self.url}: {what}: {str(e)[len('Server error:') :].strip()}"
                ) from None
            self.close()
            raise OpenEnvError(f"openenv server {self.url}: {what}: {_why(e)}") from e
        except Exception as e:  # noqa: BLE001 - every transport failure becomes one error that names the server
            self.close()
            raise OpenEnvError(f"openenv server {self.url}: {what}: {_why(e)}") from e

    async def _raise_parting_error(self) -> None:
        """A server that refuses a session (no free slot) sends its reason and closes at once, so sending the first
        message can fail before that reason is read: read it from what the socket received, as the error it is."""
        ws = self.client._ws
        if ws is None:
            return
        try:
            message = json.loads(await asyncio.wait_for(ws.recv(), 1.0))
        except Exception:  # noqa: BLE001 - nothing (readable) was left: the failure stands as it is
            return
        if isinstance(message, dict) and message.get("type") == "error":
            data = message.get("data") or {}
            raise RuntimeError(f"Server error: {data.get('message', 'unknown error')} (code: {data.get('code')})")

    def close(self, wait: bool = True) -> None:
        """Ends the session: OpenEnv's `close` message, then the server closes the socket. (GenericEnvClient's
        disconnect closes it from this side at once, and the server's own close then fails with a logged error.)

        Args:
            wait: wait for the close to finish; False only schedules it on the client loop (a finalizer: the
                garbage collector may run it on the loop's own thread, where waiting would block that loop, and
                every other session's call with it, until the deadline).
        """

        async def bye():
            ws = self.client._ws
            if ws is None:
                return
            try:
                await self.client._send({"type": "close"})
                await asyncio.wait_for(ws.wait_closed(), self.timeout_s)
            finally:
                await self.client.disconnect()  # a no-op once the server closed; closes a socket it left open

        if not wait:
            asyncio.run_coroutine_threadsafe(asyncio.wait_for(bye(), 2 * self.timeout_s + 1), _loop())
            return
        try:
            _run(bye(), 2 * self.timeout_s + 1)
        except Exception:  # noqa: BLE001 - closing a broken connection is best effort; the server drops it anyway
            pass


def describe(url: str, timeout_s: float) -> dict:
    """The server's kind, environment and tools (module docstring: agentrl, mcp, actions), the tools as our state
    lists them (name, doc, parameters, returns). OpenEnvError in one line naming what the server lacks when it is
    none of the three.

    Args:
        url: the server's http:// or ws:// URL.
        timeout_s: seconds for connecting and for each answer.

    Returns:
        {kind, environment, class_name, knobs, has_reward, tools}.
    """
    session = Session(url, timeout_s)
    try:
        state = session.call("reading its tools (state)", session.client.state)
        tools = state.get("tools") if isinstance(state, dict) else None
        if isinstance(tools, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
            return {**state, "kind": "agentrl"}
        listed = _listed_tools(session)
    finally:
        session.close()
    foreign = {"environment": FOREIGN, "knobs": {}, "has_reward": True}
    if listed:
        specs = [_spec_from_schema(t.get("name"), t.get("description"), t.get("input_schema"), url) for t in listed]
        return {**foreign, "kind": "mcp", "class_name": "MCPTools", "tools": specs}
    action = _action_schema(url, timeout_s)
    if action and action.get("properties"):
        spec = _spec_from_schema(ACT_TOOL, action.get("description") or action.get("title"), action, url)
        return {**foreign, "kind": "actions", "class_name": str(action.get("title") or "Action"), "tools": [spec]}
    raise OpenEnvError(
        f"openenv server {url}: offers no tools: its state lists none (an agentrl server's does), it answers no "
        "list_tools action (an MCP environment's does) and GET /schema gives no step action with fields "
        f"(a typed-action environment's does); state keys: {sorted(state or {})[:10]}"
    )


def _listed_tools(session: "Session") -> Optional[list[dict]]:
    """The tools an MCP environment lists (OpenEnv's `list_tools` step action), None when it answers none."""
    try:
        answer = session.call("listing its tools (list_tools)", session.client.step, {"type": "list_tools"})
    except OpenEnvError:  # not an MCP environment: its step refused the action
        return None
    tools = answer.observation.get("tools") if isinstance(answer.observation, dict) else None
    if isinstance(tools, list) and tools and all(isinstance(t, dict) for t in tools):
        return tools
    return None


def _action_schema(url: str, timeout_s: float) -> Optional[dict]:
    """The JSON schema of the server's step action (openenv-core's GET /schema), None when it gives none."""
    import urllib.request

    http = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/")
    try:
        with urllib.request.urlopen(f"{http}/schema", timeout=timeout_s) as answer:  # noqa: S310 - the user's URL
            body = answer.read(MAX_SCHEMA_BYTES + 1)
        schema = json.loads(body) if len(body) <= MAX_SCHEMA_BYTES else None
    except (OSError, ValueError):
        return None
    action = schema.get("action") if isinstance(schema, dict) else None
    if not isinstance(action, dict) or not isinstance(action.get("properties"), dict):
        return None
    return {**action, "properties": {k: v for k, v in action["properties"].items() if k != "metadata"}}


def _spec_from_schema(name: Any, description: Any, schema: Any, url: str) -> dict:
    """A tool spec as our state lists them, from a JSON schema of the tool's arguments: one parameter per property,
    annotated by its JSON type (Optional, default None, when not required), and a docstring with an Args line each
    (the form TRL's renderer, transformers' get_json_schema, reads). Names and annotations are then checked as any
    served tool's are (_tool_method)."""
    where = f"openenv server {url}: tool {str(name)[:60]!r}"
    if not isinstance(name, str) or not isinstance(schema, dict) or not isinstance(schema.get("properties", {}), dict):
        raise OpenEnvError(f"{where}: a listed tool needs a name and an input schema with 'properties'")
    props, required = schema.get("properties") or {}, set(schema.get("required") or [])
    params, lines = [], []
    for pname in sorted(props, key=lambda p: p not in required):  # a signature lists the required ones first
        prop = props[pname] if isinstance(props[pname], dict) else {}
        typ = _JSON_TYPES.get(prop.get("type"), "Any")
        choices = prop.get("enum")
        if isinstance(choices, list) and choices and all(isinstance(c, (str, int)) for c in choices):
            literal = f"Literal[{', '.join(repr(c) for c in choices)}]"  # rendered as the schema's enum again
            typ = literal if len(literal) <= MAX_ANNOTATION_CHARS - 10 else typ
        param = {"name": pname, "annotation": typ}
        if pname not in required:
            default = prop.get("default")
            param.update(default=default, annotation=f"Optional[{typ}]" if default is None else typ)
        params.append(param)
        lines.append(f"    {pname}: {' '.join(str(prop.get('description') or prop.get('title') or pname).split())}")
    doc = " ".join(str(description or name).split()) + ("\n\nArgs:\n" + "\n".join(lines) if lines else "")
    return {"name": name, "doc": doc, "parameters": params, "returns": "str"}


def answer_text(observation: Any, kind: str) -> Optional[str]:
    """What the policy reads from an observation: our server's `text`; an MCP call's result (its error as
    `error: ...`); a typed observation's fields (one string field as it is, several as compact JSON). None when the
    observation says nothing (an MCP environment's reset)."""
    if not isinstance(observation, dict):
        return None if observation is None else str(observation)
    if kind == "agentrl":
        return observation.get("text")
    if kind == "mcp" and ("result" in observation or "error" in observation):
        error = observation.get("error")
        if error:
            return f"error: {error.get('message') if isinstance(error, dict) else error}"
        result = observation.get("result")
        if isinstance(result, dict):  # a FastMCP CallToolResult as JSON: its data, else its text contents
            texts = [c.get("text") for c in result.get("content") or [] if isinstance(c, dict) and c.get("text")]
            result = result.get("data") if result.get("data") is not None else "\n".join(texts) or result
        return result if isinstance(result, str) else json.dumps(result)
    fields = {k: v for k, v in observation.items() if v not in (None, "", [], {}) and k not in ("tool_name",)}
    if not fields:
        return None
    only = next(iter(fields.values()))
    return only if len(fields) == 1 and isinstance(only, str) else json.dumps(fields, sort_keys=True)


def _annotation(text: Optional[str], where: str):
    """A served annotation's text as a type, built from _TYPE_NAMES only.

    Args:
        text: the annotation as the server wrote it ("str", "Optional[int]"), or None.
        where: the server and tool, for the error.

    Returns:
        The type (inspect.Parameter.empty when there is none).
    """
    if text is None:
        return inspect.Parameter.empty
    if not isinstance(text, str) or len(text) > MAX_ANNOTATION_CHARS:
        raise OpenEnvError(f"{where}: annotation is not a string of at most {MAX_ANNOTATION_CHARS} characters")

    def build(node):
        if isinstance(node, ast.Name) and node.id in _TYPE_NAMES:
            return _TYPE_NAMES[node.id]
        if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
            return node.value
        if isinstance(node, ast.Tuple):
            return tuple(build(e) for e in node.elts)
        if isinstance(node, ast.Subscript):
            return build(node.value)[build(node.slice)]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return typing.Union[build(node.left), build(node.right)]
        raise ValueError(f"unsupported element {ast.dump(node)[:60]}")

    try:
        return build(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as e:
        raise OpenEnvError(f"{where}: annotation {text!r} is not a plain type ({e})") from None


def _usable_name(name: str) -> bool:
    """A Python identifier that is not a keyword: what a method or a parameter can be called."""
    return name.isidentifier() and not keyword.iskeyword(name)


def _tool_method(spec: dict, url: str):
    """A method that calls a served tool on the instance's session, with the tool's real signature and doc.

    Args:
        spec: the tool as the server's state lists it (name, doc, parameters, returns).
        url: the server, for errors.

    Returns:
        The function, to be set on the class under the tool's name.
    """
    name = spec["name"]
    where = f"openenv server {url}: tool {name[:60]!r}"
    if not _usable_name(name) or name.startswith("_") or name in ("reset", "get_reward"):
        raise OpenEnvError(f"{where}: not a usable tool name (a Python identifier, not reset/get_reward)")
    if hasattr(RemoteEnvironment, name):  # `url`, `timeout_s`, `close`: the client's own members
        raise OpenEnvError(f"{where}: the name is the client's own attribute; a tool cannot shadow it")
    served = spec.get("parameters") or []
    if not isinstance(served, list) or not all(isinstance(p, dict) for p in served):
        raise OpenEnvError(f"{where}: 'parameters' must be a list of {{name, annotation, default}} objects")
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for param in served:
        pname = param.get("name")
        if not isinstance(pname, str) or not _usable_name(pname) or pname == "self":
            raise OpenEnvError(f"{where}: parameter name {str(pname)[:60]!r} is not a Python identifier (or is self)")
        default = param.get("default", inspect.Parameter.empty)
        ann = _annotation(param.get("annotation"), where)
        params.append(
            inspect.Parameter(pname, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=ann)
        )
    returns = _annotation(spec.get("returns"), where)
    try:
        signature = inspect.Signature(params, return_annotation=returns)
    except ValueError as e:  # a duplicate name, a default before a parameter without one
        raise OpenEnvError(f"{where}: its parameters are not a valid signature ({e})") from None

    def tool(self, *args, **kwargs):
        if args:  # positional arguments are named by the signature; keyword arguments go as they are (the server's
            bound = signature.bind_partial(self, *args, **kwargs).arguments  # method reports any mismatch itself)
            kwargs = {k: v for k, v in bound.items() if k != "self"}
        return self._call(name, kwargs)

    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = spec.get("doc")
    tool.__signature__ = signature
    tool.__annotations__ = {param.name: param.annotation for param in params[1:] if param.annotation is not param.empty}
    if returns is not inspect.Parameter.empty:
        tool.__annotations__["return"] = returns
    return tool


class RemoteEnvironment:
    """Base of the classes remote_environment_class makes: one OpenEnv session per instance. Its own members are
    private (a public function would be a tool to TRL); the tools and get_reward are added per server."""

    url: str = ""
    timeout_s: float = 10.0
    environment: str = ""
    kind: str = "agentrl"  # describe's kinds: agentrl, mcp, actions

    def __init__(self):
        self._session: Optional[Session] = None
        self._reward: Optional[float] = None
        self._requests = 0  # calls sent on this instance's sessions (echoed by our server: _step)
        self._lost: Optional[str] = "no episode: reset was not called"

    def reset(self, **row) -> Optional[str]:
        try:
            json.dumps(row)
        except (TypeError, ValueError) as e:
            raise OpenEnvError(f"openenv server {self.url}: reset: the row is not JSON ({e})") from None
        reused = self._session is not None
        if self._session is None:
            self._session = Session(self.url, self.timeout_s)
        try:
            try:
                result = self._session.call("reset", self._session.client.reset, **row)
            except OpenEnvError as e:
                if not reused or isinstance(e, ServerRefused):
                    raise
                # a pooled session the server closed while idle (openenv_server.IDLE_TIMEOUT_S): once more, anew
                self._session = Session(self.url, self.timeout_s)
                result = self._session.call("reset", self._session.client.reset, **row)
        except OpenEnvError as e:  # a refusal (its reason in the message) leaves the session open: closed here
            self._session.close()
            self._session, self._lost = None, str(e)
            raise
        self._reward, self._lost = finite_reward(result.reward, f"openenv server {self.url}: reset"), None
        return answer_text(result.observation, self.kind)

    def _step(self, tool: str, arguments: dict):
        """The server's StepResult for one action; OpenEnvError (session dropped) when the episode is lost."""
        if self._lost is not None:
            raise OpenEnvError(self._lost)
        self._requests += 1
        request = {"metadata": {REQUEST_KEY: self._requests}}  # ours echoes it: a reply is matched to its request
        # a typed-action server's step takes the action's fields; ours and MCP ones OpenEnv's MCP call shape
        action = (
            arguments if self.kind == "actions" else {"type": "call_tool", "tool_name": tool, "arguments": arguments}
        )
        try:
            result = self._session.call(f"tool '{tool}'", self._session.client.step, {**action, **request})
            answered = result.observation.get("request") if isinstance(result.observation, dict) else None
            if self.kind == "agentrl" and answered != self._requests:  # e.g. a server that sent two replies to one
                raise OpenEnvError(
                    f"openenv server {self.url}: tool '{tool}': the reply answers request {answered}, not request "
                    f"{self._requests} (a reply too many or too few): the session is out of step"
                )
        except ServerRefused:
            raise  # the call was refused (e.g. an action its schema rejects): the episode goes on
        except OpenEnvError as e:
            if self._session is not None:
                self._session.close()
            self._session, self._lost = None, f"{e} (the episode's session is closed)"
            raise
        self._reward = finite_reward(result.reward, f"openenv server {self.url}: tool '{tool}'")
        return result

    def _call(self, tool: str, arguments: dict) -> str:
        """A tool's answer; a transport failure is EnvironmentLost, which the tool loop turns into an `error: ...`
        answer and a broken episode (stages count those apart from wrong answers)."""
        try:
            text = answer_text(self._step(tool, arguments).observation, self.kind)
        except ServerRefused as e:  # the policy's call was wrong: an error answer, as a tool that raised gives
            return f"error: {str(e).split(': ', 2)[-1][:300]}"
        except OpenEnvError as e:
            raise EnvironmentLost(str(e)) from None
        return text if isinstance(text, str) else json.dumps(text)

    def _episode_solved(self, row: dict, text: str) -> Optional[bool]:
        """Solved by the served environment's own rule (registry.episode_solved on the server, which saw the row); a
        foreign server's episode when its reward reached 1 (the rule of a custom environment with get_reward)."""
        if self.kind != "agentrl":
            return self._reward is not None and self._reward >= 1.0
        try:
            return self._step(JUDGE_TOOL, {"text": text}).observation.get("solved")
        except OpenEnvError:
            return False  # a lost episode is unsolved, as a broken in-process environment is

    @not_a_tool
    def close(self) -> None:
        """End the episode's session now (the loop calls it once the episode is judged; TRL offers it no policy)."""
        if self._session is not None:
            self._session.close()
        self._session, self._lost = None, "no episode: the session was closed"

    def __del__(self):
        # at interpreter shutdown the client loop's thread may be gone: closing would wait out its deadline
        if getattr(self, "_session", None) is not None and sys is not None and not sys.is_finalizing():
            self._session.close(wait=False)


def _get_reward(self) -> float:
    """The served environment's get_reward() after the episode's last call (the server sends it with each answer)."""
    return 0.0 if self._reward is None else float(self._reward)


def remote_environment_class(
    url: str, environment: Optional[str] = None, knobs: Optional[dict] = None, timeout_s: float = 10.0
) -> type:
    """A class in TRL's environment_factory shape whose instances play episodes on the OpenEnv server at `url`.

    Args:
        url: the server's URL (http://host:port).
        environment: the agent.environment the run names; the server must serve that one (None: any).
        knobs: the constructor knobs params give it; the server's must be the same (None: not checked).
        timeout_s: seconds for connecting and for each answer.

    Returns:
        The class (its tools and get_reward are the server's).
    """
    state = describe(url, timeout_s)
    served = state.get("environment")
    if environment is not None and served != environment:
        hint = (
            f"set agent.environment: {FOREIGN} to train on what it serves ({state['kind']} tools)"
            if served == FOREIGN
            else f"set agent.environment: {served}"
        )
        raise OpenEnvError(f"openenv server {url} serves '{served}', but agent.environment is '{environment}': {hint}")
    if knobs is not None and (state.get("knobs") or {}) != knobs:
        raise OpenEnvError(
            f"openenv server {url} runs '{served}' with knobs {state.get('knobs')}, but params.environments give "
            f"{knobs}: start it with the same params (make env-server) or use agent.environment_url: serve"
        )
    members: dict[str, Any] = {"url": url, "timeout_s": timeout_s, "environment": served or "", "kind": state["kind"]}
    for spec in state["tools"]:
        members[spec["name"]] = _tool_method(spec, url)
    if state.get("has_reward"):
        members["get_reward"] = _get_reward
    name = f"{state.get('class_name') or 'Environment'}OverOpenEnv"
    return type(name, (RemoteEnvironment,), members)


_SERVED: dict[str, tuple[str, Any]] = {}  # agent.environment_url: serve -> one server per environment and knobs


def _stop_served() -> None:
    for _, proc in _SERVED.values():
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - a server that ignores SIGTERM is killed
            proc.kill()
    _SERVED.clear()


def environment_over_openenv(environment_url: str, environment: str, knobs: dict, timeout_s: float) -> type:
    """The environment class for `agent.environment_url`: a server's URL, or `serve` (a server for `environment`
    started on a free 127.0.0.1 port, once per process, stopped when the process exits).

    Args:
        environment_url: agent.environment_url.
        environment: agent.environment (the data and the solved rule stay this environment's).
        knobs: its constructor knobs from params.environments.
        timeout_s: agent.tool_timeout_s: seconds for connecting and for each answer.

    Returns:
        The class (remote_environment_class).
    """
    if environment_url == "serve":
        import atexit

        key = json.dumps([environment, knobs], sort_keys=True)
        if key not in _SERVED:
            if not _SERVED:
                atexit.register(_stop_served)
            _SERVED[key] = spawn(environment, knobs)
        environment_url = _SERVED[key][0]
    return remote_environment_class(environment_url, environment, knobs, timeout_s)


def spawn(
    name: str, knobs: Optional[dict] = None, timeout_s: float = STARTUP_TIMEOUT_S
) -> tuple[str, subprocess.Popen]:
    """Start `python -m agentrl.serving.openenv_server` for `name` on a free 127.0.0.1 port (agent.environment_url:
    serve). The child exits when this process's end of its stdin closes (this process exited or died), so it never
    outlives the stage.

    Args:
        name: a registry name or `module:Class`.
        knobs: the class's constructor keyword arguments.
        timeout_s: how long the child may take to print its URL.

    Returns:
        (url, process).
    """
    cmd = [sys.executable, "-m", "agentrl.serving.openenv_server", "--env", name, "--port", "0"]
    cmd += ["--knobs", json.dumps(knobs or {}), "--exit-with-stdin"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().strip() if ready else ""
    if not line.startswith("http://"):
        proc.kill()
        raise RuntimeError(
            f"agent.environment_url serve: the OpenEnv server for '{name}' did not start within {timeout_s:g} s "
            f"(exit code {proc.poll()}; its stderr above says why)"
        )
    return line, proc

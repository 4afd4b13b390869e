"""Any registered environment served over OpenEnv (issue 42):
`python -m agentrl.serving.openenv_server --env countdown`.

The app is openenv-core's own `create_app` around `ServedEnvironment`, which wraps one instance of an environment in
TRL's `environment_factory` shape (envs/tasks.py ENVIRONMENTS or `module:Class`) per WebSocket session:

  reset   the row goes in reset's kwargs (`{"type": "reset", "data": row}`); the observation's `text` is what the
          environment's reset returned (null when it returned None, as TRL's loop needs to know)
  step    one tool call in OpenEnv's MCP action shape, `{"type": "call_tool", "tool_name": name, "arguments": {...}}`
          -> `text` (the tool's answer, or `error: ...` for an unknown tool, bad arguments, an oversized action or a
          tool that raised; also in `result`, where OpenEnv's MCPToolClient reads it), `reward` (the environment's
          get_reward() after the call, null without one) and `done` (its `done` attribute, false without one);
          `{"type": "list_tools"}` -> the tools as MCP lists them (name, description, input schema)
  state   the episode id and step count plus `environment`, `knobs`, `has_reward` and `tools`: each tool's name,
          docstring, parameters (name, annotation as written, JSON default) and return annotation, so a client can
          rebuild the methods with their real signatures (openenv_client), and its JSON schema for other clients

So openenv-core's `MCPToolClient` lists and calls the tools (its default transport, the WebSocket's step), as does
our client (openenv_client), which also reads `state`. One more call, tool `_episode_solved` with `{"text":
final_text}`, answers `solved`: whether the episode was solved by the environment's own rule (registry.episode_solved
with the row reset saw). A tool's name never starts with "_", so the policy cannot reach it through a tool call, and
list_tools does not list it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_types import (
    CallToolAction,
    CallToolObservation,
    ListToolsAction,
    ListToolsObservation,
    Tool,
)
from openenv.core.env_server.types import Observation, State

from ..envs.contract import environment_tools
from ..envs.openenv_client import JUDGE_TOOL, MAX_MESSAGE_BYTES, REQUEST_KEY
from ..envs.registry import call_tool, environment_spec, episode_solved, get_environment
from ..http_limits import HeaderDeadline

MAX_TOOL_NAME_CHARS = 64
MAX_ACTION_CHARS = 8192  # a step's arguments as JSON: bigger is an error observation (no tool takes more)
MAX_RESULT_CHARS = 65536  # what a tool answers over the wire (our loop then cuts it to tools.MAX_RESULT_CHARS)
MAX_SESSIONS = 1024  # concurrent episodes (TRL pools one instance per rollout of a batch; ours one per completion)
# a session with no message for this long is closed (its slot freed): longer than any gap between an episode's calls
# (a policy generating) and between TRL's reuses of a pooled session (a training step); the client then reconnects
IDLE_TIMEOUT_S = 900.0


class ToolObservation(Observation):
    """What reset answered (`text`: null when the environment's reset returned None)."""

    text: Optional[str] = None


class ToolCallObservation(CallToolObservation):
    """What a tool call answered: `text` (also MCP's `result`), for the judge whether the episode was solved, and
    `request`: the call's number its action carried (openenv_client matches each reply to its request)."""

    text: Optional[str] = None
    solved: Optional[bool] = None
    request: Optional[int] = None


def _annotation_text(annotation) -> Optional[str]:
    """An annotation as its source text ("str", "Optional[int]"), None when absent."""
    if annotation is inspect.Parameter.empty:
        return None
    if isinstance(annotation, str):  # `from __future__ import annotations`: already the source text
        return annotation
    if isinstance(annotation, type):
        return annotation.__name__
    return repr(annotation).replace("typing.", "")


def tool_spec(name: str, method: Callable) -> dict:
    """What a client needs to rebuild a tool method: name, docstring, parameters and return annotation (as written),
    and the JSON schema transformers renders it with (None when it cannot: no docstring or type hints).

    Args:
        name: the tool's name (the method's).
    """
    from transformers.utils import get_json_schema

    sig = inspect.signature(method)
    params = []
    for param in sig.parameters.values():
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise ValueError(
                f"tool '{name}': parameter '{param.name}' is {param.kind.description}; tools take named arguments"
            )
        entry = {"name": param.name, "annotation": _annotation_text(param.annotation)}
        if param.default is not param.empty:
            json.dumps(param.default)  # a default that JSON cannot carry is the server's error, raised at start
            entry["default"] = param.default
        params.append(entry)
    try:
        schema = get_json_schema(method)
    except Exception:  # noqa: BLE001 - an undocumented custom tool is still served; only the schema is missing
        schema = None
    doc = getattr(method, "__doc__", None)
    return {
        "name": name,
        "doc": doc,
        "parameters": params,
        "returns": _annotation_text(sig.return_annotation),
        "schema": schema,
    }


class ServedEnvironment(Environment):
    """One environment instance behind one OpenEnv session (the class `create_app` builds per WebSocket)."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # every session has its own instance; nothing is shared

    def __init__(self, name: str, knobs: dict):
        super().__init__()
        self.name, self.knobs = name, dict(knobs)
        self.env = get_environment(name)(**self.knobs)
        self.tools = environment_tools(self.env)
        self.has_reward = callable(getattr(self.env, "get_reward", None))
        self.row: Optional[dict] = None
        self._state = State(episode_id=None, step_count=0)

    def reset(self, **row: Any) -> ToolObservation:
        """A new episode: the environment's reset(**row). Every key is the row's, `seed` included (a gridworld row's
        slip seed), so OpenEnv's own seed/episode_id parameters are not taken from it. A reset that fails ends the
        previous episode too (a later step must not continue it) and is refused with 422 naming why: a bad row is
        the caller's error, not the server's (it was a 500 with a traceback)."""
        from fastapi import HTTPException

        self.row = None
        self._state = State(episode_id=uuid.uuid4().hex, step_count=0)
        try:
            obs = self.env.reset(**row)
        except Exception as error:  # noqa: BLE001 - any failure of the environment's reset is this row's refusal
            raise HTTPException(422, f"reset refused the row: {type(error).__name__}: {str(error)[:200]}") from None
        self.row = dict(row)
        return ToolObservation(text=None if obs is None else str(obs), reward=self._reward(), done=False)

    def step(self, action: CallToolAction | ListToolsAction, timeout_s: Optional[float] = None, **kwargs: Any):
        """One tool call; every failure is an `error: ...` observation, as tools.Episode answers it in-process. A call
        with no episode (no reset yet, or the last one failed) is refused with 409; listing the tools needs none."""
        from fastapi import HTTPException

        if isinstance(action, ListToolsAction):
            return ListToolsObservation(tools=self._mcp_tools(), reward=None, done=False)
        if self.row is None:
            raise HTTPException(409, "no episode: reset first (or the last reset failed)")
        self._state.step_count += 1
        name = action.tool_name
        request = action.metadata.get(REQUEST_KEY)
        request = request if isinstance(request, int) and not isinstance(request, bool) else None
        if name == JUDGE_TOOL:
            text = action.arguments.get("text")
            solved = episode_solved(self.row or {}, text if isinstance(text, str) else "", self.env)
            return ToolCallObservation(
                tool_name=name, solved=solved, request=request, reward=self._reward(), done=self._done()
            )
        size = len(json.dumps(action.arguments, default=str))
        fn = self.tools.get(name)
        if size > MAX_ACTION_CHARS:
            text = f"error: arguments of {size} characters (at most {MAX_ACTION_CHARS})"
        elif fn is None:
            text = f"error: unknown tool '{name[:40]}'; available: {', '.join(self.tools)}"
        else:
            text, _ = call_tool(fn, **action.arguments)  # a raise becomes "error: ...", as in our loop
        text = text[:MAX_RESULT_CHARS]
        return ToolCallObservation(
            tool_name=name[:MAX_TOOL_NAME_CHARS],
            text=text,
            result=text,
            request=request,
            reward=self._reward(),
            done=self._done(),
        )

    def _mcp_tools(self) -> list[Tool]:
        """The tools as MCP lists them: name, description and input schema (transformers' rendering of the method,
        the one TRL shows the policy; an undocumented tool gets its parameter names only)."""
        tools = []
        for name, fn in self.tools.items():
            spec = tool_spec(name, fn)
            function = (spec["schema"] or {}).get("function", {})
            params = [p["name"] for p in spec["parameters"]]
            schema = function.get("parameters") or {"type": "object", "properties": {p: {} for p in params}}
            tools.append(
                Tool(name=name, description=function.get("description") or spec["doc"] or "", input_schema=schema)
            )
        return tools

    def close(self) -> None:
        """The session ended (openenv-core calls this): the wrapped environment's optional close() too."""
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

    def _reward(self) -> Optional[float]:
        return float(self.env.get_reward()) if self.has_reward else None

    def _done(self) -> bool:
        return bool(getattr(self.env, "done", False))

    @property
    def state(self) -> State:
        """OpenEnv's state plus what a client builds its tool methods from."""
        return State(
            episode_id=self._state.episode_id,
            step_count=self._state.step_count,
            environment=self.name,
            class_name=type(self.env).__name__,
            knobs=self.knobs,
            has_reward=self.has_reward,
            tools=[tool_spec(name, fn) for name, fn in self.tools.items()],
        )


def build_app(name: str, knobs: Optional[dict] = None, max_sessions: int = MAX_SESSIONS):
    """The FastAPI app (openenv-core's `create_app`) serving environment `name` with constructor `knobs`; the
    environment is built once here so that a bad name or knob fails at start, not at the first session.

    Args:
        name: a registry name (envs/tasks.py ENVIRONMENTS) or `module:Class`.
        max_sessions: concurrent WebSocket sessions (episodes) at most.

    Returns:
        The app, for uvicorn.
    """
    import functools

    from openenv.core.env_server.http_server import create_app

    factory = functools.partial(ServedEnvironment, name, dict(knobs or {}))
    factory().state  # noqa: B018 - builds the instance and the tool specs once: errors surface before serving
    # CallToolAction as the action class: openenv-core then routes OpenEnv's MCP actions (call_tool, list_tools) to step
    return create_app(factory, CallToolAction, ToolCallObservation, env_name=name, max_concurrent_envs=max_sessions)


def _limit_bodies(app, max_bytes: int = MAX_MESSAGE_BYTES):
    """The app, except that an HTTP request body over `max_bytes` is answered 413 without reaching it: by its
    Content-Length, or, streamed without one, once the bytes read pass the limit (uvicorn caps WebSocket messages at
    the same size, ws_max_size; POST /reset and /step took 100 MB bodies)."""

    async def too_large(send):
        body = json.dumps({"detail": f"request body over {max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    async def limited(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > max_bytes:
            return await too_large(send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > max_bytes:
                raise BodyTooLarge
            return message

        try:
            await app(scope, counted, send)
        except BodyTooLarge:
            await too_large(send)

    return limited


class BodyTooLarge(Exception):
    """A streamed request body passed the limit (_limit_bodies)."""


def _close_idle_sessions(app, idle_s: Optional[float] = None):
    """The app, except that a WebSocket session with no message for `idle_s` ends as if its client had left (1,030
    idle sockets held every slot: the 1,025th real client got CAPACITY_REACHED)."""
    import asyncio

    idle_s = IDLE_TIMEOUT_S if idle_s is None else idle_s

    async def wrapped(scope, receive, send):
        if scope["type"] != "websocket":
            return await app(scope, receive, send)

        async def receive_or_idle():
            try:
                return await asyncio.wait_for(receive(), idle_s)
            except asyncio.TimeoutError:
                return {"type": "websocket.disconnect", "code": 1001}  # "going away": openenv ends the session

        return await app(scope, receive_or_idle, send)

    return wrapped


def _quiet_disconnects(app):
    """The app, except that a WebSocket the client closed first ends quietly: openenv-core's endpoint then closes
    it again and starlette raises WebSocketDisconnect, which uvicorn would log as an ASGI error (nothing is lost:
    the session was already destroyed)."""
    from starlette.websockets import WebSocketDisconnect

    async def wrapped(scope, receive, send):
        try:
            await app(scope, receive, send)
        except WebSocketDisconnect:
            if scope["type"] != "websocket":
                raise

    return wrapped


def _uvicorn_server(app, host: str):
    import uvicorn

    config = uvicorn.Config(
        _quiet_disconnects(_close_idle_sessions(_limit_bodies(app))),
        host=host,
        log_level="warning",
        access_log=False,
        ws_max_size=MAX_MESSAGE_BYTES,
        http=HeaderDeadline,  # a request header must arrive whole within http_limits.HEADER_TIMEOUT_S
    )
    return uvicorn.Server(config)


def _listening_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # connections wait in the backlog until uvicorn accepts them
    return sock


@dataclass
class BackgroundServer:
    """A server running in a thread of this process (tests, the benchmark): `url`, and `stop()`."""

    url: str
    server: Any
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve_in_thread(name: str, knobs: Optional[dict] = None, host: str = "127.0.0.1") -> BackgroundServer:
    """Serve environment `name` on a free port of `host` from a daemon thread.

    Args:
        name: a registry name or `module:Class`.

    Returns:
        The running server (its URL is http://host:port).
    """
    sock = _listening_socket(host, 0)
    server = _uvicorn_server(build_app(name, knobs), host)
    server.install_signal_handlers = lambda: None  # not the main thread
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"openenv-{name}")
    thread.start()
    return BackgroundServer(f"http://{host}:{sock.getsockname()[1]}", server, thread)


def _exit_when_stdin_closes() -> None:
    sys.stdin.read()  # returns at EOF: the parent is gone
    os._exit(0)


def main(argv: Optional[list[str]] = None) -> None:
    """The CLI: serve one environment until interrupted (`make env-server ENV=<name> PORT=<port>`)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", required=True, help="registry name (calculator, countdown, ...) or module:Class")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0: a free port (the URL is printed first)")
    ap.add_argument("--params", default="params.yaml", help="its environments.<env> section gives the knobs")
    ap.add_argument("--knobs", default=None, help="the knobs as a JSON object instead of --params")
    ap.add_argument("--exit-with-stdin", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.knobs is not None:
        knobs = json.loads(args.knobs)
        if not isinstance(knobs, dict):
            ap.error(f"--knobs must be a JSON object, got {args.knobs!r}")
    else:  # read as YAML, not validated as a whole (config imports tools, which imports this package); the
        import yaml  # environment's constructor checks each knob it takes

        with open(args.params) as f:
            env_params = (yaml.safe_load(f) or {}).get("environments")
        if not isinstance(env_params, dict):
            ap.error(f"--params {args.params}: no 'environments' section (a mapping of environment -> knobs)")
        try:  # the runtime knobs, as the tool loop gives them (registry.environment_spec)
            knobs = environment_spec(args.env, env_params).env
        except ValueError as error:
            ap.error(f"--params {args.params}: {error}")
    app = build_app(args.env, knobs)
    sock = _listening_socket(args.host, args.port)
    print(f"http://{args.host}:{sock.getsockname()[1]}", flush=True)
    sys.stdout = sys.stderr  # the URL line is the only stdout: `spawn` reads it and nothing drains the pipe after
    if args.exit_with_stdin:
        threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()
    _uvicorn_server(app, args.host).run(sockets=[sock])


if __name__ == "__main__":
    main()

"""OpenEnv servers that are not ours, written in OpenEnv's own idiom (issue 55): what a user brings by URL.

- `EchoEnvironment`: an MCPEnvironment whose FastMCP server publishes one tool, `echo(message)`, as OpenEnv's
  echo_env does; served with `create_app(..., CallToolAction, CallToolObservation)`, so it answers OpenEnv's
  list_tools / call_tool actions. Its reward is 1.0 once the episode's word (reset(word=...)) has been echoed.
- `GridEnvironment`: a plain Environment with a typed step action (`GridAction(action: "UP" | ... )`) and a typed
  observation (position, message), as OpenEnv's grid-world environments are: no tool list at all. Reward 1.0 and
  done at the goal, the far corner of a size x size grid.
- `SilentEnvironment`: neither (an action with no field, no tools): what the client must refuse in one line.

`serve(app)` runs an app on a free 127.0.0.1 port in a thread, with openenv-core's uvicorn setup as ours. To try one
by hand (examples/environments/openenv-foreign.yaml): `python tests/openenv_foreign.py mcp --port 8001`.
"""

from __future__ import annotations

from typing import Any, Literal, Optional
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State

from agentrl.serving.openenv_server import BackgroundServer, _listening_socket, _uvicorn_server


class EchoEnvironment(MCPEnvironment):
    """Echoes messages back; the episode is won by echoing its word."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("echo")
        self.word: Optional[str] = None
        self.won = False

        @mcp.tool
        def echo(message: str) -> str:
            """Echo a message back.

            Args:
                message: the text to echo.
            """
            self.won = self.won or message.strip() == self.word
            return message

        super().__init__(mcp)
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, word: str = "hello", **kwargs: Any):
        self.word, self.won = word, False
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return Observation(done=False, reward=0.0)

    async def step_async(self, action, timeout_s: Optional[float] = None, **kwargs: Any):  # the server's path
        self._state.step_count += 1
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction):
            observation.reward = 1.0 if self.won else 0.0
        return observation

    def _step_impl(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"error": "echo takes MCP actions only"})

    @property
    def state(self) -> State:
        return self._state


class GridAction(Action):
    """Move one cell on the grid."""

    action: Literal["UP", "DOWN", "LEFT", "RIGHT"]


class GridObservation(Observation):
    position: list[int]
    message: str


class GridEnvironment(Environment):
    """Walk from (0, 0) to the far corner of a size x size grid."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    MOVES = {"UP": (-1, 0), "DOWN": (1, 0), "LEFT": (0, -1), "RIGHT": (0, 1)}

    def __init__(self, size: int = 2):
        super().__init__()
        self.size, self.position = size, [0, 0]
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GridObservation:
        self.position = [0, 0]
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GridObservation(position=self.position, message=f"start at 0 0, goal at {self.size - 1} {self.size - 1}")

    def step(self, action: GridAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GridObservation:
        self._state.step_count += 1
        dr, dc = self.MOVES[action.action]
        self.position = [
            min(max(self.position[0] + dr, 0), self.size - 1),
            min(max(self.position[1] + dc, 0), self.size - 1),
        ]
        goal = self.position == [self.size - 1, self.size - 1]
        return GridObservation(
            position=self.position, message="goal" if goal else "moved", reward=1.0 if goal else 0.0, done=goal
        )

    @property
    def state(self) -> State:
        return self._state


class SilentEnvironment(Environment):
    """An environment with nothing to call: its action has no field and its state lists no tools."""

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0)

    def step(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return Observation(done=True, reward=0.0)

    @property
    def state(self) -> State:
        return State(episode_id=None, step_count=0)


def apps() -> dict:
    """Each server as OpenEnv builds one: create_app(environment factory, action class, observation class)."""
    return {
        "mcp": create_app(
            EchoEnvironment, CallToolAction, CallToolObservation, env_name="echo_env", max_concurrent_envs=64
        ),
        "actions": create_app(
            GridEnvironment, GridAction, GridObservation, env_name="grid_world", max_concurrent_envs=64
        ),
        "none": create_app(SilentEnvironment, Action, Observation, env_name="silent"),
    }


def serve(app, host: str = "127.0.0.1") -> BackgroundServer:
    """Serve `app` on a free port of `host` from a daemon thread (as openenv_server.serve_in_thread does ours)."""
    import threading

    sock = _listening_socket(host, 0)
    server = _uvicorn_server(app, host)
    server.install_signal_handlers = lambda: None
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="openenv-foreign")
    thread.start()
    return BackgroundServer(f"http://{host}:{sock.getsockname()[1]}", server, thread)


if __name__ == "__main__":
    import argparse

    import uvicorn

    ap = argparse.ArgumentParser(description="serve one of these OpenEnv servers until interrupted")
    ap.add_argument("kind", choices=["mcp", "actions", "none"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    args = ap.parse_args()
    uvicorn.run(apps()[args.kind], host=args.host, port=args.port, log_level="warning")

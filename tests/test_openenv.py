"""OpenEnv both ways (issue 42): our environments served with openenv-core's `create_app` (serving/openenv_server.py)
and played over OpenEnv in TRL's environment_factory shape (envs/openenv_client.py, agent.environment_url).

(a) each registered environment's server plays a demonstration through openenv-core's own GenericEnvClient and
answers what the environment answers in-process; (b) plain TRL GRPOTrainer(environment_factory=<client class>)
trains against a server; (c) our pipeline's GRPO path with agent.environment_url: serve gives the same rollouts and
weights as in-process; (d) servers that refuse, hang or answer malformed JSON are clear errors naming the URL.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time

import pytest
import torch
import yaml
from transformers import LogitsProcessor, LogitsProcessorList

from agentrl.agent.tools import _ANNOTATION
from agentrl.envs.contract import environment_tools
from agentrl.envs.openenv_client import OpenEnvError, remote_environment_class
from agentrl.envs.registry import episode_solved
from agentrl.envs.tasks import ENVIRONMENTS, TASKS
from agentrl.serving.openenv_server import JUDGE_TOOL, serve_in_thread
from conftest import make_toolset, mini_params, tiny_lm

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

REGISTRY_NAMES = {"reasoning_gym": "reasoning_gym", "gymnasium": "gymnasium"}  # registered by other modules


def _json(row: dict) -> dict:
    return json.loads(json.dumps(row))  # what a row is after the wire (and after a jsonl file)


def _episode_of(name: str) -> tuple[dict, list[str], str]:
    """(row, the arguments of its demonstration's tool calls, the demonstration's text) for environment `name`."""
    if name == "calculator":
        answer = "48/2=<<48/2=24>>24 and <<24*3=72>>72 and <<1/0=x>>\n#### 72"
        return {"question": "q", "ground_truth": "72"}, [m.group(1) for m in _ANNOTATION.finditer(answer)], answer
    row = _json(TASKS[name].make_rows(1, random.Random(3), "test")[0])
    return row, [m.group(1) for m in _ANNOTATION.finditer(row["answer"])], row["answer"]


# ------------------------------------------------------------------------------ (a) every environment, served
@pytest.mark.parametrize("name", ["calculator", "countdown", "gridworld", "reasoning_gym", "gymnasium"])
def test_served_environment_plays_an_episode_through_openenv_core_client_as_in_process(name):
    """openenv-core's GenericEnvClient (WebSocket session): `state` lists the tools, reset(**row) answers the
    environment's observation, each step {tool, arguments} answers what the in-process tool answers with the
    same reward, an unknown tool and an oversized action are error observations, and the judge action applies the
    environment's own solved rule."""
    from openenv.core import GenericEnvClient

    if REGISTRY_NAMES.get(name, name) not in ENVIRONMENTS:
        pytest.skip(f"'{name}' is not registered in agentrl.agent.tools.ENVIRONMENTS yet")
    row, arguments, answer = _episode_of(name)
    local = ENVIRONMENTS[name]()
    tools = environment_tools(local)
    tool = next(iter(tools))
    want_obs = local.reset(**row)
    want = [tools[tool](a) for a in arguments]
    has_reward = callable(getattr(local, "get_reward", None))
    want_reward = local.get_reward() if has_reward else None
    want_solved = episode_solved(row, answer, local)
    assert arguments, "the demonstration makes no tool call: the episode tests nothing"

    server = serve_in_thread(name)
    try:
        with GenericEnvClient(base_url=server.url, connect_timeout_s=10, message_timeout_s=30).sync() as client:
            state = client.state()
            assert [t["name"] for t in state["tools"]] == list(tools) and state["environment"] == name
            first = client.reset(**row)
            assert first.observation["text"] == want_obs
            got = [client.step(call(tool, **{next(iter(_params(tools[tool]))): a})) for a in arguments]
            assert [g.observation["text"] for g in got] == want
            assert got[-1].reward == want_reward
            solved = client.step(call(JUDGE_TOOL, text=answer))
            assert solved.observation["solved"] == want_solved
            unknown = client.step(call("nope"))
            assert unknown.observation["text"].startswith("error: unknown tool 'nope'; available: ")
            big = {"x": "1" * 10_000}
            huge = client.step(call(tool, **big))
            assert huge.observation["text"] == f"error: arguments of {len(json.dumps(big))} characters (at most 8192)"
    finally:
        server.stop()


def call(tool: str, **arguments) -> dict:
    """One tool call as our server takes it: OpenEnv's MCP action shape."""
    return {"type": "call_tool", "tool_name": tool, "arguments": arguments}


def _params(method) -> list[str]:
    import inspect

    return list(inspect.signature(method).parameters)


def test_client_class_has_the_real_tools_and_plays_like_the_environment():
    """remote_environment_class: the same tool names, signatures and JSON schemas (what TRL renders in the prompt)
    as the in-process class, get_reward only when the environment has one, and a stateful episode (gridworld, with
    slips drawn from the row's seed) answers move for move what the in-process one answers."""
    import inspect

    from transformers.utils import get_json_schema

    from agentrl.envs.gridworld import GridWorld

    server = serve_in_thread("gridworld")
    try:
        cls = remote_environment_class(server.url, "gridworld", {})
        assert cls.__name__ == "GridWorldOverOpenEnv" and callable(getattr(cls, "get_reward", None))
        local, remote = GridWorld(), cls()
        assert list(environment_tools(remote)) == ["move"]
        assert inspect.signature(remote.move) == inspect.signature(local.move, eval_str=True)
        assert get_json_schema(remote.move) == get_json_schema(local.move)
        row = _json(TASKS["gridworld"].make_rows(1, random.Random(5), "test")[0])
        assert remote.reset(**row) == local.reset(**row)
        for d in ["right", "down", "down", "right", "look", "up", "left", "down", "right", "down"]:
            assert remote.move(d) == local.move(d)
            assert remote.get_reward() == local.get_reward()
        assert remote.move(direction="down") == local.move(direction="down")  # keyword call, as TRL makes it
        with pytest.raises(OpenEnvError, match="serves 'gridworld', but agent.environment is 'countdown'"):
            remote_environment_class(server.url, "countdown", {})
        with pytest.raises(OpenEnvError, match=r"knobs \{\}, but params.environments give \{'max_moves': 3\}"):
            remote_environment_class(server.url, "gridworld", {"max_moves": 3})
    finally:
        server.stop()
    countdown_server = serve_in_thread("countdown")
    try:
        assert not hasattr(remote_environment_class(countdown_server.url), "get_reward")
    finally:
        countdown_server.stop()


def test_a_lost_server_mid_episode_breaks_the_episode_naming_the_url():
    """A server gone mid-episode is EnvironmentLost naming the URL (TRL's loop reports a raising tool as a failed
    call); in our loop the episode's result is an error and the episode is marked broken (issue 56 item 1: it was an
    ordinary error answer, so a dead server looked like a policy that answers wrong)."""
    from agentrl.envs.contract import EnvironmentLost

    server = serve_in_thread("countdown")
    cls = remote_environment_class(server.url, "countdown", None, timeout_s=2)
    env = cls()
    env.reset(numbers=[3, 5, 3], target=24)
    assert env.check("(3+5)*3") == "24 yes"
    server.stop()
    with pytest.raises(EnvironmentLost, match=f"openenv server {server.url}: tool 'check': "):
        env.check("3+5+3")
    with pytest.raises(EnvironmentLost, match="the episode's session is closed"):  # over, not retried
        env.check("3")
    with pytest.raises(OpenEnvError, match=f"openenv server {server.url}: reset: "):
        env.reset(numbers=[3, 5, 3], target=24)


def test_a_stage_whose_episodes_lost_their_server_fails_naming_it(workdir, monkeypatch):
    """Issue 56 item 1: with the OpenEnv server gone, `evaluate` exited 0 with accuracy 0 and tool_error_rate 0.
    Now more broken episodes than agent.max_broken_share fail the stage with one line naming the count and the
    first failure, before any metrics file is written; within the share they are counted in the metrics."""
    import logging
    import sys

    import yaml

    from agentrl.config import validate_params
    from agentrl.stages import prepare
    from agentrl.stages.evaluate import evaluate

    p = mini_params()
    runtime = {k: v for k, v in p["environments"]["countdown"].items() if k in TASKS["countdown"].ENV_DEFAULTS}
    server = serve_in_thread("countdown", runtime)
    p["agent"].update(tools=[], environment="countdown", environment_url=server.url)
    p["environments"]["countdown"].update(num_train=8, num_test=6)
    (workdir / "params.yaml").write_text(yaml.safe_dump(p))
    prepare.prepare(validate_params(p))
    tok, model = tiny_lm([json.dumps(p)] * 4, 300)
    model.save_pretrained(workdir / "models/base")
    tok.save_pretrained(workdir / "models/base")
    ok = evaluate(validate_params(p), "base", log_to_trackers=False)
    assert ok["broken_episodes"] == 0 and ok["broken_episode_rate"] == 0.0

    from agentrl.stages import evaluate as stage

    real = stage.toolset_from_params

    def then_the_server_dies(*args, **kwargs):  # the stage has started and reached the server; then it is gone
        toolset = real(*args, **kwargs)
        server.stop()
        return toolset

    logged = []  # the stage's own log lines (its handler writes to the stderr of whichever test first made it)
    handler = logging.Handler()
    handler.emit = logged.append
    logging.getLogger("agentrl.eval").addHandler(handler)
    monkeypatch.setattr(stage, "toolset_from_params", then_the_server_dies)
    monkeypatch.setattr(sys, "argv", ["evaluate", "--stage", "base", "--name", "gone"])
    try:
        with pytest.raises(SystemExit) as exit_info:
            stage.main()
        assert exit_info.value.code == 1 and exit_info.value.__suppress_context__  # one line, no traceback
        last = logged[-1].getMessage()
        assert "gone: 6 of 6 episodes had a broken environment (first: environment reset failed" in last, last
        assert "agent.max_broken_share=0.01" in last
        assert not (workdir / "metrics/eval_gone.json").exists()
        monkeypatch.setattr(stage, "toolset_from_params", real)  # the server already gone at the stage's start
        with pytest.raises(SystemExit) as exit_info:
            stage.main()
        assert exit_info.value.code == 1 and exit_info.value.__suppress_context__  # issue 56 item 8: no traceback
        assert f"openenv server {server.url}: reading its tools (state)" in logged[-1].getMessage()
    finally:
        logging.getLogger("agentrl.eval").removeHandler(handler)


def test_an_episode_collected_on_the_client_loops_thread_closes_its_session_without_blocking_the_loop():
    """An episode in a reference cycle is finalized by whichever thread the garbage collector runs on, the client
    loop's own included. Its finalizer waited for the close on that loop: the loop stood still for the deadline
    (2 * timeout_s + 1) and every other session's call on it timed out (CI, `make bench-tools`' test: "reading
    its tools (state): no answer within 21 s"). Now it schedules the close and returns; the close still happens."""
    import asyncio
    import gc

    from websockets.protocol import State

    from agentrl.envs import openenv_client

    server = serve_in_thread("countdown")
    try:
        env = remote_environment_class(server.url, "countdown", None, timeout_s=30)()
        env.reset(numbers=[3, 5, 3], target=24)
        ws = env._session.client._ws
        cycle = {"env": env}
        cycle["self"] = cycle  # only the cyclic collector frees it
        del env, cycle

        async def collect_here():
            gc.collect()  # on the loop's thread: the episode's finalizer runs here

        # the old finalizer held the loop for 61 s; 20 s is only a bound on a hang, not a speed check
        asyncio.run_coroutine_threadsafe(collect_here(), openenv_client._loop()).result(timeout=20)
        for _ in range(200):  # the scheduled close: OpenEnv's close message, then the server closes the socket
            if ws.state is State.CLOSED:
                break
            time.sleep(0.1)
        assert ws.state is State.CLOSED
        assert openenv_client.describe(server.url, timeout_s=5)["environment"] == "countdown"  # the loop still serves
    finally:
        server.stop()


# ------------------------------------------------------------------------------ (d) hostile servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _silent_server():
    """A TCP server that accepts connections and never answers (the WebSocket handshake never completes)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    held = []
    stop = threading.Event()

    def accept():
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}", lambda: (stop.set(), sock.close(), [c.close() for c in held])


def _garbage_server():
    """A WebSocket server (websockets, as openenv-core's client uses) that answers every message with broken JSON."""
    import asyncio

    from websockets.asyncio.server import serve

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box = {}

    async def handler(ws):
        async for _ in ws:
            await ws.send('{"type": "state", "data": {"tools": [')

    async def main():
        box["server"] = await serve(handler, "127.0.0.1", 0)
        box["port"] = box["server"].sockets[0].getsockname()[1]
        ready.set()
        try:
            await box["server"].serve_forever()
        except asyncio.CancelledError:  # close() below ends it
            pass

    threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True).start()
    assert ready.wait(10)
    return f"http://127.0.0.1:{box['port']}", lambda: loop.call_soon_threadsafe(box["server"].close)


@pytest.mark.parametrize(
    "kind,why",
    [
        ("refused", "Connect call failed|Connection refused|Failed to connect"),
        ("hangs", "timed out|no answer within"),
        ("garbage", "malformed JSON"),
    ],
)
def test_hostile_server_is_a_clear_error_naming_the_url_within_the_timeout(kind, why):
    """At the stage's start (making the class) a server that refuses, accepts and never answers, or answers
    broken JSON is an OpenEnvError naming its URL, within the timeout (connect + one message)."""
    if kind == "refused":
        url, stop = f"http://127.0.0.1:{_free_port()}", lambda: None
    else:
        url, stop = _silent_server() if kind == "hangs" else _garbage_server()
    timeout_s = 1.5
    t = time.perf_counter()
    try:
        with pytest.raises(OpenEnvError, match=why) as e:
            remote_environment_class(url, "countdown", {}, timeout_s=timeout_s)
    finally:
        stop()
    assert str(e.value).startswith(f"openenv server {url}: "), str(e.value)
    assert time.perf_counter() - t < 2 * timeout_s + 2


def _post(url: str, path: str, body: bytes) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url + path, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_openenv_mcp_tool_client_plays_an_episode_against_our_server(tmp_path):
    """Issue 55 item 2: openenv-core's MCPToolClient got `Invalid message (code: VALIDATION_ERROR)` from `make
    env-server`: our server took its own action shape only. It now takes OpenEnv's MCP actions: the client lists the
    tools (the judge action is not one) and plays a countdown episode through call_tool, against the server the
    make target starts (`python -m agentrl.serving.openenv_server --env countdown`, params.yaml's knobs)."""
    import asyncio
    import subprocess
    import sys

    from openenv.core.mcp_client import MCPToolClient

    (tmp_path / "params.yaml").write_text(
        yaml.safe_dump({"environments": {"countdown": {"num_train": 1, "num_test": 1}}})
    )
    cmd = [sys.executable, "-m", "agentrl.serving.openenv_server", "--env", "countdown", "--port", "0"]
    server = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    async def episode(url):
        async with MCPToolClient(base_url=url, connect_timeout_s=10, message_timeout_s=30) as env:
            tools = await env.list_tools()
            await env.reset(numbers=[3, 5, 3], target=24)
            return tools, [await env.call_tool("check", expression=e) for e in ("3+5+3", "(3+5)*3")]

    try:
        url = server.stdout.readline().strip()
        assert url.startswith("http://"), url
        tools, answers = asyncio.run(episode(url))
    finally:
        server.kill()
        server.wait()
    assert [t.name for t in tools] == ["check"] and tools[0].input_schema["properties"]["expression"][
        "type"
    ] == "string"
    assert tools[0].description and answers == ["11 low", "24 yes"]


def test_a_remote_episode_closes_its_session_and_close_is_no_tool():
    """Issue 55 item 3: RemoteEnvironment.close() ends the episode's session at once (the loop calls it once the
    episode is judged); the next reset opens a new one. TRL would offer a plain public `close` to the policy as a
    tool: here it is no function on the class (contract.not_a_tool), so neither TRL nor our loop lists it."""
    import inspect

    server = serve_in_thread("countdown")
    try:
        cls = remote_environment_class(server.url, "countdown", {}, 10)
        env = cls()
        env.reset(numbers=[3, 5, 3], target=24)
        session = env._session
        env.close()
        assert env._session is None and session.client._ws is None or session.client._ws.closed
        with pytest.raises(Exception, match="no episode"):
            env._step("check", {"expression": "3+5+3"})
        env.reset(numbers=[3, 5, 3], target=24)
        assert env.check("(3+5)*3") == "24 yes"
        env.close()
    finally:
        server.stop()
    functions = inspect.getmembers(cls, predicate=inspect.isfunction)  # TRL 1.16: public, not reset/get_reward
    trl_tools = [n for n, _ in functions if n not in ("reset", "get_reward") and not n.startswith("_")]
    assert trl_tools == ["check"] and list(environment_tools(cls())) == ["check"]


def test_the_server_answers_calls_out_of_order_bad_rows_and_huge_bodies_with_4xx():
    """Issue 55 item 4: POST /step before any reset and /reset with a bad row answered 500 with a traceback in the
    server's log; /reset and /step took 100 MB bodies (RSS 428 -> 1,618 MB). Now: 409, 422 naming why, 413."""
    server = serve_in_thread("countdown")
    try:
        step = json.dumps({"action": call("check", expression="1+1")}).encode()
        assert _post(server.url, "/step", step) == (
            409,
            '{"detail":"no episode: reset first (or the last reset failed)"}',
        )
        code, text = _post(server.url, "/reset", b'{"numbers": "x"}')
        assert code == 422 and "reset refused the row: ValueError: countdown row: 'numbers' must be" in text, text
        assert _post(server.url, "/reset", b'{"numbers": [3, 5, 3], "target": 24}')[0] == 200
        import http.client
        from urllib.parse import urlparse

        where = urlparse(server.url)
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
        conn.putrequest("POST", "/reset")
        conn.putheader("Content-Length", str(100 << 20))  # announced, never sent: refused before it is read
        conn.endheaders()
        answer = conn.getresponse()
        assert answer.status == 413 and b"request body over 1048576 bytes" in answer.read()
    finally:
        server.stop()


def test_a_streamed_body_past_the_limit_is_refused_without_reaching_the_app():
    """The same limit for a body sent without Content-Length (chunked): counted as it is read."""
    import asyncio

    from agentrl.serving.openenv_server import _limit_bodies

    reached, sent = [], []

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        reached.append(True)

    async def receive():
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "headers": [(b"transfer-encoding", b"chunked")]}
    asyncio.run(_limit_bodies(app, max_bytes=10_000)(scope, receive, send))
    assert not reached and sent[0]["status"] == 413


def test_partial_headers_and_idle_sessions_are_closed_and_a_pooled_session_reconnects(monkeypatch):
    """Issue 55 item 4: 200 sockets sending a partial request header stayed open (no header timeout), and 1,030 idle
    WebSockets held every session slot (no idle timeout). Now a connection without a whole header within
    HEADER_TIMEOUT_S is closed, a session silent for IDLE_TIMEOUT_S ends (its slot freed), and a client whose pooled
    session was closed so reconnects at its next reset (TRL reuses a session across training steps). The model server
    has the same header deadline (tests/test_serve.py)."""
    import urllib.request

    from agentrl import http_limits
    from agentrl.serving import openenv_server

    monkeypatch.setattr(http_limits, "HEADER_TIMEOUT_S", 1.0)
    monkeypatch.setattr(openenv_server, "IDLE_TIMEOUT_S", 1.0)
    server = serve_in_thread("countdown")
    host, port = server.url.split("//")[1].split(":")
    try:
        slow = [socket.create_connection((host, int(port)), timeout=30) for _ in range(20)]
        for sock in slow:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
        assert all(sock.recv(100) == b"" for sock in slow), "a partial header was kept open"
        assert urllib.request.urlopen(f"{server.url}/health", timeout=10).status == 200
        env = remote_environment_class(server.url, "countdown", {}, 10)()
        env.reset(numbers=[3, 5, 3], target=24)
        first = env._session
        time.sleep(2.5)  # the server ends the silent session
        env.reset(numbers=[3, 5, 3], target=24)  # reconnects instead of failing the episode
        assert env._session is not first and env.check("(3+5)*3") == "24 yes"
        env.close()
    finally:
        server.stop()


def _double_replying_server():
    """A server that speaks our protocol but answers every step twice (a bug the issue's review planted): the second
    reply of one call would be read as the answer to the next."""
    from starlette.applications import Starlette
    from starlette.routing import WebSocketRoute

    spec = {"name": "check", "doc": "Check.\n\nArgs:\n    expression: the expression.",
            "parameters": [{"name": "expression", "annotation": "str"}], "returns": "str"}  # fmt: skip

    async def ws(socket):  # a plain starlette route: the WebSocket is its argument
        await socket.accept()
        while True:
            message = await socket.receive_json()
            kind, data = message.get("type"), message.get("data") or {}
            if kind == "state":
                state = {"environment": "countdown", "knobs": {}, "has_reward": False, "tools": [spec]}
                await socket.send_json({"type": "state", "data": state})
            elif kind == "reset":
                await socket.send_json({"type": "observation", "data": {"observation": {"text": None}}})
            elif kind == "step":
                request = (data.get("metadata") or {}).get("agentrl_request")
                for text in (f"answer to {data['arguments']['expression']}", "a reply too many"):
                    observation = {"text": text, "request": request}
                    await socket.send_json({"type": "observation", "data": {"observation": observation}})
            else:
                await socket.close()
                return

    return Starlette(routes=[WebSocketRoute("/ws", ws)])


def test_a_reply_that_answers_another_request_is_never_read_as_this_ones():
    """Issue 55 item 5: a server that sends two replies per step shifted every later answer by one (no matching of
    replies to requests). Each call now carries its number, our server echoes it, and a reply for another call
    ends the episode's session as out of step (a broken episode, counted), never a shifted answer."""
    from agentrl.envs.contract import EnvironmentLost
    from agentrl.serving.openenv_server import _listening_socket, _uvicorn_server

    sock = _listening_socket("127.0.0.1", 0)
    server = _uvicorn_server(_double_replying_server(), "127.0.0.1")
    server.install_signal_handlers = lambda: None
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        env = remote_environment_class(url, None, None, 10)()
        env.reset()
        assert env.check("1+1") == "answer to 1+1"
        with pytest.raises(EnvironmentLost, match="the reply answers request 1, not request 2"):
            env.check("2+2")  # the stale second reply to 1+1 arrives first
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_failed_reset_ends_the_previous_episode():
    """Issue 55 item 4: a reset that failed (seed "x") left the previous episode live; the next call continued it."""
    from fastapi import HTTPException
    from openenv.core.env_server.mcp_types import CallToolAction

    from agentrl.serving.openenv_server import ServedEnvironment

    env = ServedEnvironment("countdown", {})
    env.reset(numbers=[3, 5, 3], target=24)
    assert env.step(CallToolAction(tool_name="check", arguments={"expression": "(3+5)*3"})).text == "24 yes"
    with pytest.raises(HTTPException, match="reset refused the row"):
        env.reset(numbers="x", target=24)
    with pytest.raises(HTTPException, match="no episode"):
        env.step(CallToolAction(tool_name="check", arguments={"expression": "(3+5)*3"}))


HOSTILE_TOOL_LISTS = {  # (a served tool spec, what the error says): each raised a raw exception without the URL
    "a parameter named self": ({"name": "t", "parameters": [{"name": "self"}]}, "parameter name 'self'"),
    "a parameter named a-b": ({"name": "t", "parameters": [{"name": "a-b"}]}, "parameter name 'a-b'"),
    "a keyword as parameter": ({"name": "t", "parameters": [{"name": "class"}]}, "parameter name 'class'"),
    "a default before a non-default": (
        {"name": "t", "parameters": [{"name": "a", "default": 1}, {"name": "b"}]},
        "not a valid signature",
    ),
    "a duplicate parameter": ({"name": "t", "parameters": [{"name": "a"}, {"name": "a"}]}, "not a valid signature"),
    "parameters not a list": ({"name": "t", "parameters": "a"}, "'parameters' must be a list"),
    "a parameter not an object": ({"name": "t", "parameters": ["a"]}, "'parameters' must be a list"),
    "a parameter without a name": ({"name": "t", "parameters": [{"annotation": "str"}]}, "parameter name 'None'"),
    "a 100,000-term annotation": (
        {"name": "t", "parameters": [{"name": "a", "annotation": "+".join(["int"] * 100_000)}]},
        "annotation is not a string of at most 200",
    ),
    "a tool named url": ({"name": "url"}, "the client's own attribute"),
    "a tool named timeout_s": ({"name": "timeout_s"}, "the client's own attribute"),
    "a tool named environment": ({"name": "environment"}, "the client's own attribute"),
    "a tool named with a keyword": ({"name": "lambda"}, "not a usable tool name"),
}


@pytest.mark.parametrize("case", HOSTILE_TOOL_LISTS)
def test_a_served_tool_list_is_untrusted_input_refused_naming_the_url_and_tool(case):
    """Issue 55 item 5: a served tool list is validated as untrusted input; each of these raised a raw ValueError,
    AttributeError, KeyError or RecursionError without the URL, or (a tool named url or timeout_s) shadowed the
    client's own attribute so that every episode broke silently."""
    from agentrl.envs.openenv_client import _tool_method

    spec, says = HOSTILE_TOOL_LISTS[case]
    with pytest.raises(OpenEnvError, match=says) as e:
        _tool_method(spec, "http://h:1")
    assert str(e.value).startswith(f"openenv server http://h:1: tool {spec['name']!r}"), str(e.value)


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), "1", True])
def test_a_served_reward_that_is_not_a_finite_number_is_refused(reward):
    """Issue 55 item 5: a NaN reward was accepted (one NaN makes every advantage of its GRPO group NaN)."""
    from types import SimpleNamespace

    from agentrl.envs.openenv_client import RemoteEnvironment

    env = RemoteEnvironment()
    env.url, env._lost = "http://h:1", None
    answer = SimpleNamespace(reward=reward, observation={"text": "ok", "request": 1})  # the reply to call 1
    env._session = SimpleNamespace(client=SimpleNamespace(step=None), call=lambda *a: answer, close=lambda: None)
    with pytest.raises(OpenEnvError, match="openenv server http://h:1: tool 'act': reward .* not a finite number"):
        env._step("act", {})


def test_environment_url_is_validated_by_form_and_needs_an_environment():
    from pydantic import ValidationError

    from agentrl.config import AgentParams

    agent = mini_params()["agent"]
    for value, match in [
        ("localhost:8000", "environment_url must be null, 'serve' or a URL"),
        ("http://127.0.0.1:8000", "agent.environment_url plays agent.environment over OpenEnv"),
    ]:
        with pytest.raises(ValidationError, match=match):
            AgentParams(**{**agent, "environment_url": value})
    ok = AgentParams(**{**agent, "environment": "countdown", "tools": [], "environment_url": "serve"})
    assert ok.environment_url == "serve"


# ------------------------------------------------------------------------------ (b) TRL's own loop, over OpenEnv
def _chat_lm(texts: list[str]):
    from trl.chat_template_utils import qwen3_chat_template

    tok, model = tiny_lm(texts, 400, max_position_embeddings=1024)
    tok.chat_template = qwen3_chat_template
    return tok, model


class FirstTurnCalls(LogitsProcessor):
    """Forces each rollout's first assistant turn to be `call` then eos, and every later turn to end at once: the
    tool call TRL's loop then parses and runs (the tiny policy would not write one by itself)."""

    def __init__(self, tok, call: str):
        self.tok = tok
        self.call = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        self.header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]

    def __call__(self, input_ids, scores):
        h = self.header
        for r in range(input_ids.shape[0]):
            row = [t for t in input_ids[r].tolist() if t != self.tok.pad_token_id]
            starts = [j + len(h) for j in range(len(row) - len(h) + 1) if row[j : j + len(h)] == h]
            pos = len(row) - starts[-1]
            want = self.call[pos] if len(starts) == 1 and pos < len(self.call) else self.tok.eos_token_id
            scores[r, :] = -1e9
            scores[r, want] = 0
        return scores


def _alternating(completions, **kwargs) -> list[float]:
    """A reward that differs inside each group of 2 whatever the (forced, identical) episodes did, so that two steps
    have an advantage to learn from."""
    return [float(i % 2) for i in range(len(completions))]


@pytest.mark.slow
def test_trl_grpo_trainer_trains_on_an_openenv_client_class(tmp_path):
    """Plain TRL: GRPOTrainer(environment_factory=<client class>). TRL renders the served tool in the prompt, the
    policy (taught to open with a move) calls it over the wire in TRL's own loop, the served gridworld's get_reward
    is a reward column named after the class, every rollout's episode is reset on the server, and two steps change
    the weights."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    server = serve_in_thread("gridworld")
    try:
        cls = remote_environment_class(server.url, "gridworld", {})
        resets, moves = [], []

        def reset(self, **row):
            resets.append(row["seed"])
            return cls.reset(self, **row)

        def move(self, direction: str) -> str:
            moves.append(direction)
            return cls.move(self, direction)

        move.__doc__, move.__signature__ = cls.move.__doc__, cls.move.__signature__
        counted = type(cls.__name__, (cls,), {"reset": reset, "move": move})  # the name TRL's reward column takes
        rows = [_json(r) for r in TASKS["gridworld"].make_rows(4, random.Random(0), "train")]
        prompts = [[{"role": "user", "content": r["question"]}] for r in rows]
        call = '<tool_call>\n{"name": "move", "arguments": {"direction": "right"}}\n</tool_call>'
        probe, _ = _chat_lm(["x"] * 4)
        texts = [probe.apply_chat_template(p, tools=[counted().move], add_generation_prompt=True, tokenize=False)
                 + call for p in prompts]  # fmt: skip
        tok, model = _chat_lm(texts * 4)
        generate = model.generate  # TRL calls model.generate(**inputs, generation_config=...) each turn
        forced = LogitsProcessorList([FirstTurnCalls(tok, call)])
        model.generate = lambda *a, **k: generate(*a, logits_processor=forced, **k)
        ds = Dataset.from_list([{"prompt": p, **r} for p, r in zip(prompts, rows)])
        before = [p.detach().clone() for p in model.parameters()]
        args = GRPOConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=64,
            max_steps=2, learning_rate=1e-2, report_to=[], use_cpu=True, bf16=False, fp16=False, seed=0,
            logging_steps=1, save_strategy="no", max_tool_calling_iterations=2,
        )  # fmt: skip
        trainer = GRPOTrainer(model=model, reward_funcs=[_alternating], args=args, train_dataset=ds,
                              processing_class=tok, environment_factory=counted)  # fmt: skip
        trainer.train()
    finally:
        server.stop()
        del model.generate
    logs = {k for log in trainer.state.log_history for k in log}
    assert trainer.state.global_step == 2
    assert len(resets) == 2 * 4 and set(resets) <= {r["seed"] for r in rows}
    assert moves, "the policy never called the served tool in TRL's loop"
    assert f"rewards/{cls.__name__}/mean" in logs, sorted(logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), "two steps changed nothing"


# ------------------------------------------------------------------------------ (c) in-process == over OpenEnv
def _teach_calls(tok, model, texts: list[str], steps: int = 60) -> None:
    """A few dozen plain LM steps on the demonstrations, so that sampled completions open tool calls (`<<..=`)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    enc = tok(texts, return_tensors="pt", padding=True)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    model.train()
    for _ in range(steps):
        loss = model(**enc, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def _grpo_run(params, tok, model_state, rows, tmp_path, tag: str):
    """Our pipeline's GRPO path (grpo.build_trainer: the stage's trainer, ToolRollout, rewards from params) for two
    steps; returns the rollouts it produced and the final weights."""
    import copy

    from datasets import Dataset
    from trl import GRPOConfig

    from agentrl.stages.grpo import build_trainer

    model = copy.deepcopy(model_state)
    args = GRPOConfig(
        output_dir=str(tmp_path / tag), per_device_train_batch_size=8, num_generations=4, max_completion_length=24,
        max_steps=2, learning_rate=1e-3, report_to=[], use_cpu=True, bf16=False, fp16=False, seed=0,
        logging_steps=1, save_strategy="no", temperature=1.0,
    )  # fmt: skip
    trainer = build_trainer(params, args, model, tok, Dataset.from_list(rows))
    rollout = trainer.rollout_func
    assert trainer.ledger is None and rollout is not None, "the inline format runs our loop (ToolRollout)"
    seen = []

    def recording(prompts, trainer):
        out = rollout(prompts, trainer)
        seen.append({k: out[k] for k in ("prompt_ids", "completion_ids", "env_mask", "tool_calls", "solved")})
        return out

    trainer.rollout_func = recording
    trainer.train()
    return seen, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_countdown_over_openenv_gives_the_same_rollouts_and_weights_as_in_process(tmp_path):
    """agent.environment_url: serve (the stage starts the server subprocess) vs null, same seed: the same prompt and
    completion ids (tool results included: they are completion tokens), the same solved flags (judged by the
    server) and, after two GRPO steps, the same weights. The model is taught to call the tool first, so the
    rollouts do make calls over the wire."""
    from agentrl.config import validate_params
    from agentrl.data import messages
    from agentrl.envs import openenv_client

    raw = mini_params()
    raw["agent"].update(environment="countdown", tools=[], format="inline")
    raw["grpo"]["use_lora"] = False  # all weights train: the comparison sees every one
    rows = [_json(r) for r in TASKS["countdown"].make_rows(4, random.Random(1), "train")]
    rows = [{**r, "prompt": messages("", r["question"])} for r in rows]
    tok, model = tiny_lm([r["question"] + r["answer"] for r in rows] * 8, 300)
    _teach_calls(tok, model, [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
                              + r["answer"] for r in rows])  # fmt: skip

    local_rolls, local_w = _grpo_run(validate_params(raw), tok, model, rows, tmp_path, "local")
    raw["agent"]["environment_url"] = "serve"
    try:
        remote_rolls, remote_w = _grpo_run(validate_params(raw), tok, model, rows, tmp_path, "remote")
        assert len(openenv_client._SERVED) == 1, "serve started one server for the stage"
    finally:
        openenv_client._stop_served()
    assert sum(sum(r["tool_calls"]) for r in local_rolls) > 0, "no tool call was made: the comparison tests nothing"
    assert remote_rolls == local_rolls
    assert local_w.keys() == remote_w.keys()
    assert all(torch.equal(local_w[k], remote_w[k]) for k in local_w), "weights differ after two steps"


@pytest.mark.slow
def test_bench_openenv_transport_times_both_paths_on_the_same_rollouts():
    """`make bench-tools`' OpenEnv row: both paths time the same forced rollouts (it raises when they differ) and the
    ratio is the median of the rounds' paired ratios."""
    import statistics

    from agentrl.benchmarks.openenv_transport import openenv_transport
    from agentrl.config import load_params
    from conftest import ROOT

    r = openenv_transport(load_params(ROOT / "params.yaml"), n=6, rounds=2)
    assert r["rollouts"] == 6 and r["tool_calls"] >= 6  # every countdown demonstration checks at least once
    assert r["in_process_seconds"]["runs"] == r["openenv_seconds"]["runs"] == 2
    assert r["ratio"] == statistics.median(r["round_ratios"]) > 0


# ------------------------------------------------------------------------- (d) anyone's OpenEnv server by URL
@pytest.fixture(scope="module")
def foreign():
    """OpenEnv's own kinds of server (tests/openenv_foreign.py): MCP tools, a typed step action, and neither."""
    from openenv_foreign import apps, serve

    servers = {kind: serve(app) for kind, app in apps().items()}
    yield {kind: server.url for kind, server in servers.items()}
    for server in servers.values():
        server.stop()


def test_an_mcp_servers_tools_become_the_policys_tools(foreign):
    """Issue 55 item 1: an echo_env-style server (its tools over MCP) was refused ("its state has no 'tools' list ...
    not an agentrl environment server"). Its listed tools become methods with the schema TRL renders, called with
    OpenEnv's call_tool; its reward is the server's, and an episode is solved when it reaches 1."""
    from transformers.utils import get_json_schema

    cls = remote_environment_class(foreign["mcp"], "openenv", {}, 10)
    assert cls.kind == "mcp" and environment_tools(cls()).keys() == {"echo"}
    env = cls()
    schema = get_json_schema(env.echo)["function"]
    assert schema["description"] == "Echo a message back." and schema["parameters"]["required"] == ["message"]
    assert schema["parameters"]["properties"]["message"] == {"type": "string", "description": "the text to echo."}
    assert env.reset(word="hi") is None
    assert (env.echo("nope"), env.get_reward(), episode_solved({}, "", env)) == ("nope", 0.0, False)
    assert (env.echo(message="hi"), env.get_reward(), episode_solved({}, "", env)) == ("hi", 1.0, True)


def test_a_typed_action_server_becomes_one_tool_act(foreign):
    """A grid_world-style server (a typed step action, no tool list) was refused the same way. Its action schema is
    one tool, `act` (the enum a Literal, rendered back as the schema's enum); the answer is the observation; an
    action the schema refuses is an error answer and the episode goes on (not a lost server)."""
    from transformers.utils import get_json_schema

    cls = remote_environment_class(foreign["actions"], "openenv", {}, 10)
    env = cls()
    assert cls.kind == "actions" and environment_tools(env).keys() == {"act"}
    action = get_json_schema(env.act)["function"]["parameters"]["properties"]["action"]
    assert action["enum"] == ["UP", "DOWN", "LEFT", "RIGHT"]
    assert env.reset(seed=1) == '{"message": "start at 0 0, goal at 1 1", "position": [0, 0]}'
    assert env.act("NORTH") == "error: Invalid message (code: VALIDATION_ERROR)"
    assert env.act("DOWN") == '{"message": "moved", "position": [1, 0]}' and env.get_reward() == 0.0
    assert env.act(action="RIGHT").startswith('{"message": "goal"') and episode_solved({}, "", env) is True


def test_a_server_offering_neither_is_refused_before_any_stage_in_one_line(foreign, workdir):
    """A server with no tool list, no MCP tools and no step action fields stops `prepare` (the first stage) in one
    line naming the URL and what it lacks; a foreign server under a built-in agent.environment names the fix."""
    import subprocess
    import sys

    def prepare_with(environment: str, url: str) -> subprocess.CompletedProcess:
        p = mini_params()
        p["agent"].update(environment=environment, tools=[], environment_url=url)
        (workdir / "params.yaml").write_text(yaml.safe_dump(p))
        cmd = [sys.executable, "-m", "agentrl.stages.prepare"]
        return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=300)

    run = prepare_with("openenv", foreign["none"])
    errors = [line for line in run.stderr.splitlines() if " ERROR " in line]
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert len(errors) == 1 and foreign["none"] in errors[0], run.stderr[-2000:]
    assert "offers no tools: its state lists none" in errors[0] and not (workdir / "data/prepared").exists()
    with pytest.raises(OpenEnvError, match="agent.environment is 'countdown': set agent.environment: openenv"):
        remote_environment_class(foreign["mcp"], "countdown", {}, 10)  # what prepare checks, in one line too
    ok = prepare_with("openenv", foreign["mcp"])
    assert ok.returncode == 0 and "server kind mcp, tools echo" in ok.stderr, ok.stderr[-2000:]


def test_a_servers_refusal_reason_reaches_the_episodes_error_text():
    """Issue 55 item 3: with a server allowing one session (create_app's default), every batched episode failed with
    `environment reset failed: ConnectionClosedOK ...`: the server's "at capacity" reason was lost. It now reaches the
    broken episode's text whole, and the refused session is closed."""
    from openenv.core.env_server.http_server import create_app

    from agentrl.agent.tools import Call
    from openenv_foreign import GridAction, GridEnvironment, GridObservation, serve

    server = serve(create_app(GridEnvironment, GridAction, GridObservation, env_name="grid_world"))  # one session
    try:
        cls = remote_environment_class(server.url, "openenv", {}, 10)
        ts = make_toolset(None, "chat", max_calls=2, environment="openenv", env_class=cls)
        first, second = ts.episode({"seed": 1}), ts.episode({"seed": 2})
        assert first.broken is None and second.env is None
        assert "reset failed: ServerRefused" in second.broken and "Server at capacity: 1/1" in second.broken, (
            second.broken
        )
        first.close()
        third = ts.episode({"seed": 3})  # the slot is free again once the first episode ended
        assert third.broken is None and third.run(Call("act", {"action": "DOWN"}))[0].startswith('{"message": "moved"')
        third.close()
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("kind, call", [("mcp", "<<hi="), ("actions", "<<DOWN=")])
def test_grpo_trains_on_a_foreign_server_by_url(foreign, kind, call, tmp_path):
    """Acceptance (issue 55): our GRPO path trains two steps on each foreign kind by URL (agent.environment openenv);
    the policy's calls reach the server and its reward, and the weights change."""
    from agentrl.config import validate_params
    from agentrl.data import messages

    raw = mini_params()
    raw["agent"].update(environment="openenv", tools=[], format="inline", environment_url=foreign[kind])
    raw["grpo"]["use_lora"] = False  # all weights train: the comparison sees every one
    rows = [{"prompt": messages("", f"Say hi {i}"), "question": f"Say hi {i}", "ground_truth": "hi", "word": "hi"}
            for i in range(4)]  # fmt: skip
    answer = f"{call}\n#### hi"
    tok, model = tiny_lm([r["question"] + answer for r in rows] * 8, 300)
    _teach_calls(tok, model, [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
                              + answer for r in rows])  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    rolls, weights = _grpo_run(validate_params(raw), tok, model, rows, tmp_path, kind)
    assert sum(sum(r["tool_calls"]) for r in rolls) > 0, "the policy never called the server's tool"
    assert any(not torch.equal(a, b) for a, b in zip(before, weights.values())), "two steps changed nothing"

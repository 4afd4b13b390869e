"""The MCP server (agentrl.api.mcp_server) driven over stdio by the official SDK's client."""

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client

from agentrl.api import actions as agent_api
from agentrl.api import checks as agent_checks
from agentrl.api import mcp_server
from conftest import tool_env
from test_agent_api import make_repo, sh, snapshot


@pytest.fixture
def repo(copy_repo, monkeypatch):
    return make_repo(copy_repo, monkeypatch)


def server_params(repo: Path) -> StdioServerParameters:
    env = tool_env("disabled")
    return StdioServerParameters(
        command=sys.executable, args=["-m", "agentrl.api.mcp_server", "--repo", str(repo)], env=env, cwd=str(repo)
    )


def session(repo: Path, body):
    """Run `await body(session)` against a fresh server process over stdio."""

    async def main():
        async with stdio_client(server_params(repo)) as (read, write):
            async with ClientSession(read, write) as s:
                await s.initialize()
                return await body(s)

    return asyncio.run(main())


def payload(result) -> dict:
    out = json.loads(result.content[0].text)
    assert result.structured_content == out
    assert result.is_error == ("error" in out)
    return out


def test_tools_have_schemas_and_bad_arguments_are_structured_errors(repo):
    before = snapshot(repo)

    async def body(s):
        tools = {t.name: t for t in (await s.list_tools()).tools}
        calls = {
            "unknown_key": await s.call_tool("run_experiment", {"overrides": {"eval.batch_sise": 2}, "name": "x"}),
            "wrong_type": await s.call_tool("run_experiment", {"overrides": {"seed": "forty-two"}}),
            "unknown_exp": await s.call_tool("compare", {"a": "workspace", "b": "no-such-experiment"}),
            "eval_unknown": await s.call_tool("evaluate", {"experiment": "nope", "n": 3}),
            "describe": await s.call_tool("describe", {}),
            "status": await s.call_tool("status", {}),
            # issue 26 item 6: 100,000 keys (>120 s of quadratic validation before) are refused by size
            "huge": await s.call_tool("run_experiment", {"overrides": {f"k{i}": 1 for i in range(100_000)}}),
            "interpolation": await s.call_tool("run_experiment", {"overrides": {"serve.host": "${oc.env:HOME}"}}),
            "import_path": await s.call_tool("run_experiment", {"overrides": {"agent.tools": ["this:s"]}}),
        }
        return tools, calls

    tools, calls = session(repo, body)
    assert set(tools) == set(agent_api.ACTIONS)
    for t in tools.values():
        assert t.input_schema["type"] == "object" and t.description
    props = tools["run_experiment"].input_schema["properties"]
    assert props["overrides"]["type"] == "object" and props["mode"]["enum"] == list(agent_api.MODES)
    assert tools["compare"].input_schema["required"] == ["a", "b"]
    expected = {
        "unknown_key": ("unknown_key", "eval.batch_sise"),
        "wrong_type": ("wrong_type", "seed"),
        "unknown_exp": ("unknown_experiment", "b"),
        "eval_unknown": ("unknown_experiment", "experiment"),
        "huge": ("request_too_large", "overrides"),
        "interpolation": ("invalid_value", "serve.host"),
        "import_path": ("not_allowed", "agent.tools"),
    }
    for name, (type_, key) in expected.items():
        err = payload(calls[name])["error"]
        assert calls[name].is_error and (err["type"], err["key"]) == (type_, key), (name, err)
    assert "Traceback" not in json.dumps([payload(c) for c in calls.values()])
    assert os.environ["HOME"] not in json.dumps(payload(calls["interpolation"]))
    described = payload(calls["describe"])
    assert described["params_schema"]["properties"].keys() >= {"seed", "data", "eval"}
    assert payload(calls["status"])["runs"] == []
    assert snapshot(repo) == before
    assert agent_api.experiment_names(repo) == []


def test_tool_schemas_are_strict_and_publish_exactly_the_actions_arguments():
    tools = {t.name: t for t in asyncio.run(mcp_server.server.list_tools())}
    assert set(tools) == set(agent_api.ACTIONS)
    for name, tool in tools.items():
        assert tool.input_schema["additionalProperties"] is False, name
        assert set(tool.input_schema["properties"]) == agent_api.ARGUMENTS[name], name


def test_unknown_and_mistyped_tool_arguments_are_refused_as_the_python_api_refuses_them(repo, monkeypatch):
    """Issue 45 item 6: the SDK's argument model dropped `overides` (the baseline ran, is_error false) and read
    start_queue "yes" as true (a queue worker started). In-process through the server's own call path (the
    transport aside), with DVC replaced by a recorder: every call is refused with the agent API's JSON error and
    nothing runs."""
    ran = []
    monkeypatch.setattr(agent_api, "_stream", lambda root, cmd, run: ran.append(cmd) or (1, ""))
    monkeypatch.setattr(agent_api, "_dvc", lambda root, *args, check=True: ran.append(args))
    monkeypatch.setattr(mcp_server, "ROOT", str(repo))
    cases = [
        ("run_experiment", {"overides": {"seed": 3}}, "unknown_argument", "overides"),
        ("run_experiment", {"mode": "queue", "name": "q", "start_queue": "yes"}, "wrong_type", "start_queue"),
        ("run_experiment", {"overrides": '{"seed": 3}'}, "wrong_type", "overrides"),  # JSON in a string stays text
        ("run_experiment", {"overrides": {}, "name": 7}, "wrong_type", "name"),
        ("evaluate", {"n": 4.0}, "wrong_type", "n"),
        ("evaluate", {"n": "4"}, "wrong_type", "n"),
        ("list_experiments", {"all_commits": 1}, "wrong_type", "all_commits"),
        ("compare", {"a": "workspace", "b": "workspace", "stage_": "sft"}, "unknown_argument", "stage_"),
        ("describe", {"verbose": True}, "unknown_argument", "verbose"),
        ("status", {"all": True}, "unknown_argument", "all"),
    ]
    for tool, args, type_, key in cases:
        result = asyncio.run(mcp_server.server.call_tool(tool, args))
        out = payload(result)
        assert result.is_error and (out["error"]["type"], out["error"]["key"]) == (type_, key), (tool, args, out)
        assert out == agent_api.call(tool, args, root=repo)  # the same answer as a Python call
    assert ran == []


def test_unreadable_lines_get_json_rpc_errors_and_the_session_goes_on(tmp_path):
    """Issue 56: `{not json` used to get no reply at all (the SDK's transport only logged it), so a client waited
    forever. Now: -32700 for a line that is not JSON, -32600 for JSON that is not a JSON-RPC message, and the next
    request is answered as usual."""
    import subprocess
    import threading

    lines = ["{not json", "[1, 2]", '{"jsonrpc": "2.0", "id": 7, "method": "ping"}']
    server = subprocess.Popen(
        [sys.executable, "-m", "agentrl.api.mcp_server", "--repo", str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=tool_env("disabled"),
    )
    no_reply = threading.Timer(60, server.kill)  # a missing reply fails the test instead of hanging it
    no_reply.start()
    try:  # stdin stays open until the replies are read, as a client's does (closing it ends the session)
        server.stdin.write("\n".join(lines) + "\n")
        server.stdin.flush()
        replies = [json.loads(server.stdout.readline() or "null") for _ in lines]
    finally:
        no_reply.cancel()
        server.stdin.close()
        server.wait(timeout=60)
    assert None not in replies, f"no reply to some of {lines}: {replies}"
    assert [(r.get("id"), r.get("error", {}).get("code")) for r in replies] == [
        (None, -32700),
        (None, -32600),
        (7, None),
    ]
    assert replies[0]["error"]["message"].startswith("Parse error")
    assert replies[2]["result"] == {}


@pytest.mark.slow
def test_run_experiment_end_to_end_over_mcp(repo):
    """A tiny override run through the MCP server: metrics and progress come back, the experiment is in
    `dvc exp show`, the workspace is untouched; a second run in mode 'workspace' is applied to the workspace and
    pairs with the first in `compare`; `evaluate` scores a model of the first. (Two runs, not three: each costs
    minutes of the CI's time.)"""
    before = snapshot(repo)
    progress, untouched = [], []

    async def on_progress(p, total, message):
        progress.append((p, total, message))

    async def body(s):
        first = await s.call_tool(
            "run_experiment", {"overrides": {"eval.batch_size": 4}, "name": "bs4"}, progress_callback=on_progress
        )
        untouched.append(snapshot(repo) == before)  # a temp run leaves the workspace alone
        listed = await s.call_tool("list_experiments", {})
        evaluated = await s.call_tool("evaluate", {"experiment": "bs4", "stage": "sft", "n": 5})
        untouched.append(snapshot(repo) == before)
        second = await s.call_tool(
            "run_experiment", {"overrides": {"eval.batch_size": 3}, "name": "bs3", "mode": "workspace"}
        )
        compared = await s.call_tool("compare", {"a": "bs4", "b": "bs3", "stage": "sft"})
        return first, second, listed, compared, evaluated

    first, second, listed, compared, evaluated = session(repo, body)
    run = payload(first)
    assert run["name"] == "bs4" and run["mode"] == "temp", run
    num_test = agent_checks.read_params(repo)["data"]["synthetic"]["num_test"]
    assert run["diagnostics"]["diagnostics/eval_grpo.json"]["num_samples"] == num_test
    assert 0.0 <= run["summary"]["grpo_accuracy"] <= 1.0
    stages_total = len(agent_api.stages(repo))
    assert progress[-1][:2] == (stages_total, stages_total) and any("stage grpo" in m for _, _, m in progress)
    assert untouched == [True, True]

    shown = json.loads(sh(["dvc", "exp", "show", "--json"], repo))
    exps = {rev["name"]: rev for b in shown for e in (b.get("experiments") or []) for rev in e["revs"]}
    assert {"bs4", "bs3"} <= set(exps)
    assert exps["bs4"]["data"]["params"]["params.yaml"]["data"]["eval"]["batch_size"] == 4
    assert (
        exps["bs4"]["data"]["metrics"]["metrics/eval_grpo.json"]["data"]["accuracy"]
        == run["metrics"]["metrics/eval_grpo.json"]["accuracy"]
    )
    assert "bs4" in {r["Experiment"] for r in payload(listed)["experiments"]}

    ev = payload(evaluated)
    assert ev["n"] == 5 and ev["metrics"]["num_samples"] == 5 and ev["stage"] == "sft"

    # mode 'workspace': the run is applied to the workspace afterwards
    out = payload(second)
    assert out.get("applied_to_workspace") is True, out
    assert agent_checks.read_params(repo)["eval"]["batch_size"] == 3
    assert (repo / "metrics/eval_grpo.json").exists()
    cmp = payload(compared)
    assert cmp["paired_test"]["n"] == num_test  # same held-out problems: the paired test ran
    assert 0.0 <= cmp["paired_test"]["p_value"] <= 1.0
    sft_a, sft_b = cmp["a"]["summary"]["sft_accuracy"], cmp["b"]["summary"]["sft_accuracy"]
    assert cmp["difference"]["sft_accuracy"] == sft_b - sft_a

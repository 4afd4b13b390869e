"""MCP server (stdio) exposing the pipeline's agent API (agentrl.api.actions) as tools.

    make mcp                                   # or: python -m agentrl.api.mcp_server [--repo PATH]

Tools: describe, run_experiment, list_experiments, compare, evaluate, status. Each returns the action's
JSON; a failed call is a tool error (isError) whose text is the JSON {"error": {"type", "key", "message"}}.
run_experiment and evaluate report MCP progress notifications (stage k of N, from DVC's output) when the
client sends a progress token.

Arguments mean exactly one thing: each tool's input schema is strict (its properties are the action's arguments,
actions.ARGUMENTS, with additionalProperties false), and the arguments reach the agent API as the client sent
them, where the API's own checks refuse an unknown key or a wrong type (`"yes"` for a boolean) with the same
JSON error as a Python call. The SDK's argument model is not used for that: it drops unknown keys, coerces
types (pydantic's lax mode) and parses JSON inside strings, so a typo would run a different configuration.

The blocking work runs in worker threads; runs are serialised by the API's file lock, so concurrent calls cannot
interleave DVC operations on the repository.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from typing import Any, Literal, Optional

import anyio
import anyio.from_thread
import anyio.to_thread
import mcp_types
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.tools import Tool
from mcp.server.mcpserver.utilities.func_metadata import FuncMetadata
from mcp.server.stdio import stdio_server
from mcp.shared._context_streams import create_context_streams
from mcp.shared.message import SessionMessage
from mcp.types import CallToolResult, TextContent
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import actions

INSTRUCTIONS = """Drives a DVC + TRL training pipeline (prepare -> base -> sft -> eval -> grpo -> eval -> export).
Call describe first: it returns the params schema (every knob, typed), the stages and the current metrics.
Every run is a named DVC experiment built from params overrides ({"dotted.key": value}); list_experiments
and compare read them back, compare adds a paired McNemar test when both evaluated the same problems."""

ROOT: Optional[str] = None


def _result(out: dict) -> CallToolResult:
    """The action's JSON as text and as structured content; an {"error": ...} object is a tool error."""
    return CallToolResult(
        content=[TextContent(type="text", text=json.dumps(out, indent=1))],
        structured_content=out,
        is_error="error" in out,
    )


async def _call(action: str, args: dict, ctx: Optional[Context] = None) -> CallToolResult:
    """Run one agent API action in a worker thread, reporting its progress to the client when `ctx` is given.

    Args:
        action: the agent API action (actions.ACTIONS).
        args: its arguments, as the client sent them.
        ctx: the request's context, for progress notifications (None: no progress).

    Returns:
        The action's JSON as a tool result (a tool error for an {"error": ...} answer).
    """

    def progress(done: float, total: Optional[float], message: str) -> None:
        """Called from the worker thread: hand the notification to the event loop."""
        try:
            anyio.from_thread.run(partial(ctx.report_progress, done, total, message))
        except Exception:  # a lost progress notification must not fail the run
            pass

    out = await anyio.to_thread.run_sync(
        partial(actions.call, action, args, ROOT, progress if ctx is not None else None)
    )
    return _result(out)


# ------------------------------------------------------------------------------------ input schemas
# One model per tool, used only for its JSON Schema (what list_tools publishes); extra="forbid" publishes
# additionalProperties: false. The checks themselves are the agent API's (see the module docstring).
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DescribeArgs(_Strict):
    """`describe` takes no argument."""

    pass


class RunExperimentArgs(_Strict):
    """`run_experiment`'s arguments."""

    overrides: dict[str, Any] = Field(
        default={}, description='params overrides, dotted keys: {"seed": 7, "eval.batch_size": 16}'
    )
    name: Optional[str] = Field(
        default=None,
        description="experiment name: letters, digits, '.', '_', '-'; not a branch, tag or other git revision; "
        "default: generated",
    )
    mode: Literal[actions.MODES] = Field(default="temp", description="temp | queue | workspace")
    start_queue: bool = Field(default=True, description="mode 'queue': start a queue worker (dvc queue start)")


class ListExperimentsArgs(_Strict):
    """`list_experiments`'s arguments."""

    all_commits: bool = Field(default=False, description="include experiments of earlier commits")


class CompareArgs(_Strict):
    """`compare`'s arguments: the paired test of two experiments' predictions."""

    a: str = Field(description="the 'before' experiment")
    b: str = Field(description="the 'after' experiment")
    stage: Literal[actions.EVAL_STAGES] = Field(default="grpo", description="which model's predictions to pair")


class EvaluateArgs(_Strict):
    """`evaluate`'s arguments."""

    experiment: str = Field(default="workspace", description="experiment name, git revision or 'workspace'")
    stage: Literal[actions.EVAL_STAGES] = Field(default="grpo", description="which model")
    n: int = Field(default=50, ge=1, description="number of held-out problems")


class StatusArgs(_Strict):
    """`status` takes no argument."""

    pass


class _ArgumentsAsSent(FuncMetadata):
    """Hands the client's arguments to the tool function untouched, as one `arguments` dict."""

    def validate_arguments(self, arguments_to_validate: dict[str, Any]) -> dict[str, Any]:
        return {"arguments": dict(arguments_to_validate)}


def _tool(action: str, schema: type[BaseModel], description: str) -> Tool:
    """The MCP tool of one agent API action: `schema`'s strict JSON Schema published, the arguments passed on
    as sent (the API checks them), progress reported for the actions that have it.

    Args:
        action: the agent API action (actions.ACTIONS), also the tool's name.
        schema: the model whose JSON Schema is the tool's input schema; its fields are the action's arguments.
        description: what the tool does, for the client.

    Returns:
        The tool, ready for MCPServer(tools=...).
    """
    published = schema.model_json_schema()
    if set(published.get("properties", {})) != actions.ARGUMENTS[action]:
        raise RuntimeError(
            f"{schema.__name__} publishes {published.get('properties')}, {action} takes "
            f"{sorted(actions.ARGUMENTS[action])}"
        )

    async def handler(arguments: dict[str, Any], ctx: Context) -> CallToolResult:
        return await _call(action, arguments, ctx if action in actions.PROGRESS_ACTIONS else None)

    tool = Tool.from_function(handler, name=action, description=description)
    meta = tool.fn_metadata
    as_sent = _ArgumentsAsSent(
        arg_model=meta.arg_model,
        output_schema=meta.output_schema,
        output_model=meta.output_model,
        wrap_output=meta.wrap_output,
    )
    return tool.model_copy(update={"parameters": published, "fn_metadata": as_sent})


TOOLS = [
    _tool(
        "describe",
        DescribeArgs,
        "The params schema (JSON Schema of params.yaml), the current params, the DVC stages and "
        "the workspace's current metrics. Call this first.",
    ),
    _tool(
        "run_experiment",
        RunExperimentArgs,
        "Run the pipeline as a named DVC experiment with params overrides. mode 'temp' (default) "
        "runs now in a DVC temporary workspace and returns the metrics; 'queue' queues it "
        "(dvc exp run --queue) and starts a worker, follow it with status; 'workspace' runs it "
        "like 'temp' and applies the result to the workspace (dvc exp apply). Overrides are "
        "validated against the params schema before anything runs.",
    ),
    _tool(
        "list_experiments",
        ListExperimentsArgs,
        "Experiments of the current baseline (dvc.api.exp_show rows: name, rev, state, params and metrics columns).",
    ),
    _tool(
        "compare",
        CompareArgs,
        "Compare two experiments (names, git revisions or 'workspace'): accuracy of every "
        "evaluated model side by side, and the paired test (exact McNemar, paired bootstrap CI) "
        "on `stage`'s predictions when both evaluated the same problems.",
    ),
    _tool(
        "evaluate",
        EvaluateArgs,
        "Evaluate a model (stage base/sft/grpo/merged) of an experiment or the workspace on its "
        "first n held-out problems, in a scratch directory (the workspace is not written).",
    ),
    _tool(
        "status",
        StatusArgs,
        "Runs started through this server (current stage, stages done of total) and DVC's "
        "experiment queue (queued / running / failed).",
    ),
]
server = MCPServer("agentrl", instructions=INSTRUCTIONS, tools=TOOLS)


def rejection(error: Exception) -> SessionMessage:
    """JSON-RPC's answer to a line the transport could not read as a message: -32700 when it is not JSON at all,
    -32600 when it is JSON but not a JSON-RPC message (id null: the request's id cannot be read)."""
    not_json = isinstance(error, ValidationError) and any(e["type"] == "json_invalid" for e in error.errors())
    code, what = (mcp_types.PARSE_ERROR, "Parse error") if not_json else (mcp_types.INVALID_REQUEST, "Invalid Request")
    detail = error.errors()[0]["msg"] if isinstance(error, ValidationError) and error.errors() else str(error)
    reply = mcp_types.JSONRPCError(
        jsonrpc="2.0", id=None, error=mcp_types.ErrorData(code=code, message=f"{what}: {detail[:200]}")
    )
    return SessionMessage(reply)


async def serve_stdio() -> None:
    """`server` over stdio, answering unreadable lines. The SDK's stdio transport hands such a line to the session
    as an exception, which only logs it: the client waits for a reply that never comes. Here the exception is
    answered with JSON-RPC's error (rejection) and the session sees the readable messages only."""
    lowlevel = server._lowlevel_server  # MCPServer.run_stdio_async does the same, minus the answers
    async with stdio_server() as (from_client, to_client):
        readable_in, readable_out = create_context_streams[SessionMessage | Exception](0)

        async def answer_unreadable() -> None:
            async with readable_in:
                async for item in from_client:
                    if isinstance(item, Exception):
                        await to_client.send(rejection(item))
                    else:
                        await readable_in.send(item)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(answer_unreadable)
            await lowlevel.run(readable_out, to_client, lowlevel.create_initialization_options())


def main(argv: Optional[list[str]] = None) -> None:
    """`python -m agentrl.api.mcp_server [--repo R]` (`make mcp`): the MCP server on stdio."""
    global ROOT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=os.environ.get("AGENTRL_REPO"), help="pipeline repository (default: cwd)")
    ROOT = ap.parse_args(argv).repo
    anyio.run(serve_stdio)


if __name__ == "__main__":
    main()

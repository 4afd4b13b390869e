"""MCP server (stdio) exposing the pipeline's agent API (agentrl.agent_api) as tools.

    make mcp                                   # or: python -m agentrl.mcp_server [--repo PATH]

Tools: describe, run_experiment, list_experiments, compare, evaluate, status. Each returns the action's
JSON; a failed call is a tool error (isError) whose text is the JSON {"error": {"type", "key", "message"}}.
run_experiment and evaluate report MCP progress notifications (stage k of N, from DVC's output) when the
client sends a progress token. The blocking work runs in worker threads; runs are serialised by the
API's file lock, so concurrent calls cannot interleave DVC operations on the repository.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from typing import Annotated, Any, Optional

import anyio
import anyio.from_thread
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult, TextContent
from pydantic import Field

from . import agent_api

INSTRUCTIONS = """Drives a DVC + TRL training pipeline (prepare -> base -> sft -> eval -> grpo -> eval -> export).
Call describe first: it returns the params schema (every knob, typed), the stages and the current metrics.
Every run is a named DVC experiment built from params overrides ({"dotted.key": value}); list_experiments
and compare read them back, compare adds a paired McNemar test when both evaluated the same problems."""

server = MCPServer("agentrl", instructions=INSTRUCTIONS)
ROOT: Optional[str] = None


def _result(out: dict) -> CallToolResult:
    """The action's JSON as text and as structured content; an {"error": ...} object is a tool error."""
    return CallToolResult(
        content=[TextContent(type="text", text=json.dumps(out, indent=1))],
        structured_content=out,
        is_error="error" in out,
    )


async def _call(action: str, args: dict, ctx: Optional[Context] = None) -> CallToolResult:
    def progress(p: float, total: Optional[float], message: str) -> None:
        """Called from the worker thread: hand the notification to the event loop."""
        try:
            anyio.from_thread.run(partial(ctx.report_progress, p, total, message))
        except Exception:  # a lost progress notification must not fail the run
            pass

    out = await anyio.to_thread.run_sync(
        partial(agent_api.call, action, args, ROOT, progress if ctx is not None else None)
    )
    return _result(out)


def _args(**kw: Any) -> dict:
    return {k: v for k, v in kw.items() if v is not None}


@server.tool(
    description="The params schema (JSON Schema of params.yaml), the current params, the DVC stages and "
    "the workspace's current metrics. Call this first."
)
async def describe() -> CallToolResult:
    return await _call("describe", {})


@server.tool(
    description="Run the pipeline as a named DVC experiment with params overrides. mode 'temp' (default) "
    "runs now in a DVC temporary workspace and returns the metrics; 'queue' queues it "
    "(dvc exp run --queue) and starts a worker, follow it with status; 'workspace' runs it "
    "like 'temp' and applies the result to the workspace (dvc exp apply). Overrides are "
    "validated against the params schema before anything runs."
)
async def run_experiment(
    ctx: Context,
    overrides: Annotated[
        dict[str, Any], Field(description='params overrides, dotted keys: {"seed": 7, "eval.batch_size": 16}')
    ] = {},  # noqa: B006
    name: Annotated[
        Optional[str], Field(description="experiment name (git ref characters); default: generated")
    ] = None,
    mode: Annotated[
        str, Field(description="temp | queue | workspace", json_schema_extra={"enum": list(agent_api.MODES)})
    ] = "temp",
    start_queue: Annotated[bool, Field(description="mode 'queue': start a queue worker (dvc queue start)")] = True,
) -> CallToolResult:
    return await _call("run_experiment", _args(overrides=overrides, name=name, mode=mode, start_queue=start_queue), ctx)


@server.tool(
    description="Experiments of the current baseline (dvc.api.exp_show rows: name, rev, state, params "
    "and metrics columns)."
)
async def list_experiments(
    all_commits: Annotated[bool, Field(description="include experiments of earlier commits")] = False,
) -> CallToolResult:
    return await _call("list_experiments", {"all_commits": all_commits})


@server.tool(
    description="Compare two experiments (names, git revisions or 'workspace'): accuracy of every "
    "evaluated model side by side, and the paired test (exact McNemar, paired bootstrap CI) "
    "on `stage`'s predictions when both evaluated the same problems."
)
async def compare(
    a: Annotated[str, Field(description="the 'before' experiment")],
    b: Annotated[str, Field(description="the 'after' experiment")],
    stage: Annotated[
        str,
        Field(description="which model's predictions to pair", json_schema_extra={"enum": list(agent_api.EVAL_STAGES)}),
    ] = "grpo",
) -> CallToolResult:
    return await _call("compare", {"a": a, "b": b, "stage": stage})


@server.tool(
    description="Evaluate a model (stage base/sft/grpo/merged) of an experiment or the workspace on its "
    "first n held-out problems, in a scratch directory (the workspace is not written)."
)
async def evaluate(
    ctx: Context,
    experiment: Annotated[str, Field(description="experiment name, git revision or 'workspace'")] = "workspace",
    stage: Annotated[
        str, Field(description="which model", json_schema_extra={"enum": list(agent_api.EVAL_STAGES)})
    ] = "grpo",
    n: Annotated[int, Field(description="number of held-out problems")] = 50,
) -> CallToolResult:
    return await _call("evaluate", {"experiment": experiment, "stage": stage, "n": n}, ctx)


@server.tool(
    description="Runs started through this server (current stage, stages done of total) and DVC's "
    "experiment queue (queued / running / failed)."
)
async def status() -> CallToolResult:
    return await _call("status", {})


def main(argv: Optional[list[str]] = None) -> None:
    global ROOT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=os.environ.get("AGENTRL_REPO"), help="pipeline repository (default: cwd)")
    ROOT = ap.parse_args(argv).repo
    server.run("stdio")


if __name__ == "__main__":
    main()

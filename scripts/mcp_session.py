#!/usr/bin/env python
"""A scripted agent session against the MCP server, with the official SDK's stdio client; prints a transcript.

    python scripts/mcp_session.py [--repo PATH] [--override eval.batch_size=4] [--name bs4]

Starts `python -m agentrl.api.mcp_server --repo PATH`, lists the tools, runs one experiment (progress
notifications printed as they arrive), shows a rejected override, lists the experiments and compares the
new one with the workspace. Large payloads (the full metrics, the schema) are shortened in the transcript.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from mcp import ClientSession, StdioServerParameters, stdio_client


def show(out: dict, keys) -> str:
    if "error" not in out:
        out = keys(out) if callable(keys) else {k: out[k] for k in keys if k in out} if keys else out
    return json.dumps(out, indent=1)


async def session(repo: str, overrides: dict, name: str) -> None:
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "agentrl.api.mcp_server", "--repo", repo], env=dict(os.environ)
    )
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as s:
            init = await s.initialize()
            print(f"connected: {init.server_info.name}, protocol {init.protocol_version}")
            tools = (await s.list_tools()).tools
            print("> tools/list")
            for t in tools:
                print(f"  {t.name}({', '.join(t.input_schema.get('properties', {}))})")

            async def call(tool: str, args: dict, keys=(), progress: bool = False) -> dict:
                print(f"> tools/call {tool} {json.dumps(args)}")

                async def on_progress(p: float, total: float | None, message: str | None) -> None:
                    print(f"  progress {p:g}/{total:g}: {message}")

                res = await s.call_tool(tool, args, progress_callback=on_progress if progress else None)
                out = json.loads(res.content[0].text)
                print(("< isError " if res.is_error else "< ") + show(out, keys).replace("\n", "\n  "))
                return out

            await call(
                "describe",
                {},
                lambda d: {
                    "params_schema": f"<{len(json.dumps(d['params_schema']))} chars>",
                    "stages": [st["name"] for st in d["stages"]],
                    "metrics": sorted(d["metrics"]),
                },
            )
            await call("run_experiment", {"overrides": {"eval.batch_sise": 4}})
            await call(
                "run_experiment",
                {"overrides": overrides, "name": name},
                ("name", "mode", "rev", "seconds", "summary"),
                progress=True,
            )
            await call(
                "list_experiments",
                {},
                lambda d: [{k: r.get(k) for k in ("Experiment", "rev", "typ")} for r in d["experiments"]],
            )
            await call(
                "compare",
                {"a": "workspace", "b": name, "stage": "sft"},
                ("difference", "paired_test", "paired_test_reason"),
            )
            await call("compare", {"a": name, "b": "no-such-run"})
            await call("status", {}, ("runs", "queue"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=".")
    ap.add_argument("--override", action="append", default=[], help="key=JSON value (default eval.batch_size=4)")
    ap.add_argument("--name", default="bs4")
    a = ap.parse_args()
    overrides = {k: json.loads(v) for k, v in (o.split("=", 1) for o in a.override or ["eval.batch_size=4"])}
    asyncio.run(session(os.path.abspath(a.repo), overrides, a.name))


if __name__ == "__main__":
    main()

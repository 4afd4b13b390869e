#!/usr/bin/env python
"""Client-side tool use through the OpenAI API vs the server-side tool loop, on the same held-out problems.

Starts the server on 127.0.0.1 (or uses --url) and, for each of the first N problems of the test split, with
the official `openai` client and greedy decoding:
  client  the request declares a `calculator` function; each `tool_calls` reply is run here (agentrl.agent.tools.
          calculator) and answered with a `tool` message, until a reply without calls (at most
          agent.max_tool_calls calls, as the server-side loop);
  server  the same messages without `tools`: the server runs the policy's calls itself (the default).
Both get the same token budget for the whole completion, tool tokens included (the client's later turns get
what is left: max_tokens minus the prompt growth so far). Prints both accuracies, how often the two texts are
identical, and one transcript (request tools -> tool_calls -> tool message -> answer); --out writes JSON.

    python scripts/client_tools_eval.py --model models/merged -n 100 --out eval_client_tools.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from agentrl.answers import answers_match, extract_answer, normalize_number
from agentrl.config import load_params
from agentrl.envs.calculator import calculator
from agentrl.envs.registry import call_tool
from agentrl.modeling import load_tokenizer
from agentrl.serving.local import served

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": 'e.g. "48/2" or "(3+4)*12"'}},
            "required": ["expression"],
        },
    },
}


async def client_side(api, tok, prompt: list[dict], budget: int, max_calls: int, record=None) -> dict:
    """The client's tool loop: returns {text (the turn put together), calls, turns}. The budget counts the
    completion tokens of each reply and the tokens of each tool result (`result>>`, as the loop inserts it)."""
    messages, text, calls, turns, used = list(prompt), "", 0, 0, 0
    while True:
        request = {"messages": messages, "tools": [CALCULATOR], "max_tokens": budget - used, "temperature": 0}
        resp = await api.chat.completions.create(model="agentrl", **request)
        turns += 1
        used += resp.usage.completion_tokens
        msg = resp.choices[0].message
        if record is not None:
            record.append(
                {"request": {k: v for k, v in request.items() if k != "messages"} | {"messages": messages[-2:]}}
            )
            record.append(
                {
                    "response": {
                        "message": msg.model_dump(exclude_none=True),
                        "finish_reason": resp.choices[0].finish_reason,
                    }
                }
            )
        text += msg.content or ""
        if resp.choices[0].finish_reason != "tool_calls":
            return {"text": text, "calls": calls, "turns": turns}
        if calls + len(msg.tool_calls) > max_calls:  # the server-side loop ends such a completion unanswered
            return {"text": text, "calls": calls, "turns": turns}
        messages.append(msg.model_dump(exclude_none=True))
        for c in msg.tool_calls:
            args = json.loads(c.function.arguments)
            result, _ok = call_tool(calculator, **args)
            text += f"<<{args['expression']}={result}>>"
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
            calls += 1
            used += len(tok.encode(f"{result}>>", add_special_tokens=False))
        if used >= budget:
            return {"text": text, "calls": calls, "turns": turns}


async def server_side(api, prompt: list[dict], budget: int) -> dict:
    resp = await api.chat.completions.create(model="agentrl", messages=prompt, max_tokens=budget, temperature=0)
    return {"text": resp.choices[0].message.content, "calls": len(resp.model_extra.get("tool_calls") or [])}


async def run(base: str, tok, rows: list[dict], budget: int, max_calls: int, concurrency: int) -> dict:
    from openai import AsyncOpenAI

    api = AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, row: dict):
        async with sem:
            record: list = []
            c = await client_side(api, tok, row["prompt"], budget, max_calls, record)
            s = await server_side(api, row["prompt"], budget)
            return {**c, "record": record}, s

    t0 = time.perf_counter()
    pairs = await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
    wall = time.perf_counter() - t0
    truth = [normalize_number(str(r["ground_truth"])) for r in rows]
    ok_c = [answers_match(extract_answer(c["text"]), t) for (c, _), t in zip(pairs, truth)]
    ok_s = [answers_match(extract_answer(s["text"]), t) for (_, s), t in zip(pairs, truth)]
    n = len(rows)
    shown = next((k for k, (c, _) in enumerate(pairs) if c["calls"]), 0)  # the first problem with a call
    return {
        "problems": n,
        "client_side_accuracy": sum(ok_c) / n,
        "server_side_accuracy": sum(ok_s) / n,
        "both_right": sum(a and b for a, b in zip(ok_c, ok_s)),
        "only_client_right": sum(a and not b for a, b in zip(ok_c, ok_s)),
        "only_server_right": sum(b and not a for a, b in zip(ok_c, ok_s)),
        "identical_text": sum(c["text"] == s["text"] for c, s in pairs),
        "client_tool_use_rate": sum(c["calls"] > 0 for c, _ in pairs) / n,
        "server_tool_use_rate": sum(s["calls"] > 0 for _, s in pairs) / n,
        "client_calls": sum(c["calls"] for c, _ in pairs),
        "server_calls": sum(s["calls"] for _, s in pairs),
        "client_requests": sum(c["turns"] for c, _ in pairs),
        "max_tokens": budget,
        "wall_s": round(wall, 1),
        "transcript": pairs[shown][0]["record"],
        "transcript_problem": {
            "id": rows[shown].get("id"),
            "ground_truth": rows[shown]["ground_truth"],
            "client_right": ok_c[shown],
            "server_side_text": pairs[shown][1]["text"],
        },
        "differing": [
            {"id": r.get("id"), "client": c["text"], "server": s["text"]}
            for r, (c, s) in zip(rows, pairs)
            if c["text"] != s["text"]
        ][:5],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/merged")
    ap.add_argument("--data", default="data/prepared/test.jsonl")
    ap.add_argument("-n", type=int, default=100)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: eval.max_new_tokens")
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("--url", default=None, help="use a running server instead of starting one")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    params = load_params(a.params)
    budget = a.max_tokens or params.eval.max_new_tokens
    rows = [json.loads(line) for line in Path(a.data).read_text().splitlines() if line.strip()][: a.n]
    if len(rows) < a.n:
        sys.exit(f"{a.data}: {len(rows)} problems, fewer than -n {a.n}")
    with served(a.model, a.url, params=a.params, log="client_tools_eval_server.log") as (base, _):
        tok = load_tokenizer(a.model)
        res = asyncio.run(run(base, tok, rows, budget, params.agent.max_tool_calls, a.concurrency))
    print(
        f"{res['problems']} problems, max_tokens {budget}: client-side tools {res['client_side_accuracy']:.1%}, "
        f"server-side loop {res['server_side_accuracy']:.1%}; "
        f"identical text {res['identical_text']}/{res['problems']}; "
        f"tool use {res['client_tool_use_rate']:.0%} vs {res['server_tool_use_rate']:.0%}; "
        f"{res['client_requests']} client requests; {res['wall_s']} s"
    )
    print(json.dumps(res["transcript"], indent=1, ensure_ascii=False))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

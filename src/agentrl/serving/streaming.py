"""Streaming chat completions (`stream: true`): server-sent events in OpenAI's chat.completion.chunk format."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Optional

from .engine import Engine, Sampling, complete
from .openai_tools import ToolPlan, parse_calls, safe_prefix
from .schema import usage

log = logging.getLogger(__name__)


async def chat_stream(
    e: Engine,
    ids: list[int],
    sampling: Sampling,
    cid: str,
    created: int,
    model: str,
    include_usage: bool,
    plan: Optional[ToolPlan] = None,
):
    """Server-sent events in OpenAI's chat.completion.chunk format, ending with `data: [DONE]`. With client-side
    tools, text that may become a call is held back; a call comes as tool_calls deltas (id, type and name
    first, then the arguments), as OpenAI streams them. A client that disconnects cancels the generation."""
    pieces: asyncio.Queue[str] = asyncio.Queue()

    def event(choices: list, **extra) -> str:
        return (
            "data: "
            + json.dumps(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": choices,
                    **extra,
                }
            )
            + "\n\n"
        )

    def delta(d: dict, finish: Optional[str] = None) -> str:
        return event([{"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}])

    generated, shown = "", ""  # text so far; the part of it sent as content

    def content_delta(safe: str) -> Optional[str]:
        nonlocal shown
        if len(safe) > len(shown) and safe.startswith(shown):
            piece, shown = safe[len(shown) :], safe
            return delta({"content": piece})
        return None

    def visible(text: str) -> str:
        return text if plan is None else safe_prefix(plan.prefix + text, plan)

    yield delta({"role": "assistant", "content": ""})
    task = asyncio.ensure_future(complete(e, ids, sampling, on_text=pieces.put_nowait, plan=plan))
    try:
        while True:
            getter = asyncio.ensure_future(pieces.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
            got = [getter.result()] if getter.done() and not getter.cancelled() else []
            if task.done():
                while not pieces.empty():
                    got.append(pieces.get_nowait())
            for piece in got:
                generated += piece
                out = content_delta(visible(generated))
                if out:
                    yield out
            if task.done():
                break
        r = task.result()
        finish, calls = r["finish_reason"], []
        if plan is not None:
            content, calls = parse_calls(plan.prefix + r["text"], plan, r["called"])
            out = content_delta(content or "")
        else:
            out = content_delta(r["text"])
        if out:
            yield out
        for k, c in enumerate(calls):
            head = {
                "index": k,
                "id": c["id"],
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": ""},
            }
            yield delta({"tool_calls": [head]})
            yield delta({"tool_calls": [{"index": k, "function": {"arguments": c["function"]["arguments"]}}]})
        yield delta({}, "tool_calls" if calls else finish)
        if include_usage:
            yield event([], usage=usage(r))
    except Exception:  # the status line is sent: report the error in the stream, as OpenAI does
        log.exception("generation failed while streaming")
        yield (
            "data: "
            + json.dumps(
                {"error": {"message": "internal server error", "type": "server_error", "param": None, "code": None}}
            )
            + "\n\n"
        )
    finally:
        if not task.done():  # the client disconnected (Starlette cancelled this response): stop generating
            task.cancel()
    yield "data: [DONE]\n\n"

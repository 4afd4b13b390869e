"""Streaming chat completions (`stream: true`): server-sent events in OpenAI's chat.completion.chunk format."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Iterator, Optional

from .engine import Engine, Sampling, complete
from .openai_tools import ToolPlan, parse_calls, safe_prefix
from .schema import usage

log = logging.getLogger(__name__)


class _ChunkWriter:
    """Formats the server-sent events of one streamed completion (OpenAI's chat.completion.chunk), and tracks
    how much of the generated text has been sent as content."""

    def __init__(self, cid: str, created: int, model: str):
        self.cid, self.created, self.model = cid, created, model
        self.shown = ""  # the part of the generated text sent as content so far

    def event(self, choices: list, **extra) -> str:
        """One `data: {chunk}` event with these choices (and extra top-level fields, e.g. usage)."""
        chunk = {
            "id": self.cid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return "data: " + json.dumps(chunk) + "\n\n"

    def delta(self, change: dict, finish: Optional[str] = None) -> str:
        """An event of the one choice: its delta and finish reason."""
        return self.event([{"index": 0, "delta": change, "finish_reason": finish, "logprobs": None}])

    def content_delta(self, safe: str) -> Optional[str]:
        """The content event for what `safe` (the text that may be shown) adds to what was sent, or None."""
        if len(safe) > len(self.shown) and safe.startswith(self.shown):
            piece, self.shown = safe[len(self.shown) :], safe
            return self.delta({"content": piece})
        return None

    def tool_call_deltas(self, calls: list[dict]) -> Iterator[str]:
        """Each call as OpenAI streams it: id, type and name first (empty arguments), then the arguments."""
        for index, call in enumerate(calls):
            head = {
                "index": index,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }
            yield self.delta({"tool_calls": [head]})
            yield self.delta(
                {"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]}
            )


_STREAM_ERROR = (
    "data: "
    + json.dumps({"error": {"message": "internal server error", "type": "server_error", "param": None, "code": None}})
    + "\n\n"
)


async def _next_pieces(pieces: asyncio.Queue, task: asyncio.Future) -> list[str]:
    """The text pieces generated since the last call: waits for one piece or for the generation to end; once it
    has ended, drains the queue."""
    getter = asyncio.ensure_future(pieces.get())
    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
    if not getter.done():
        getter.cancel()
    got = [getter.result()] if getter.done() and not getter.cancelled() else []
    if task.done():
        while not pieces.empty():
            got.append(pieces.get_nowait())
    return got


async def chat_stream(
    engine: Engine,
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
    first, then the arguments), as OpenAI streams them. A client that disconnects cancels the generation.

    Args:
        created: its creation time (unix seconds).
        include_usage: end with a usage chunk (stream_options.include_usage).
        plan: the request's client-side tools, or None.

    Returns:
        An async iterator of `data: ...` event strings.
    """
    pieces: asyncio.Queue[str] = asyncio.Queue()
    writer = _ChunkWriter(cid, created, model)
    generated = ""  # the text so far

    def visible(text: str) -> str:
        return text if plan is None else safe_prefix(plan.prefix + text, plan)

    yield writer.delta({"role": "assistant", "content": ""})
    task = asyncio.ensure_future(complete(engine, ids, sampling, on_text=pieces.put_nowait, plan=plan))
    try:
        while True:
            for piece in await _next_pieces(pieces, task):
                generated += piece
                out = writer.content_delta(visible(generated))
                if out:
                    yield out
            if task.done():
                break
        result = task.result()
        finish, calls = result["finish_reason"], []
        if plan is not None:
            content, calls = parse_calls(plan.prefix + result["text"], plan, result["called"])
            out = writer.content_delta(content or "")
        else:
            out = writer.content_delta(result["text"])
        if out:
            yield out
        for event in writer.tool_call_deltas(calls):
            yield event
        yield writer.delta({}, "tool_calls" if calls else finish)
        if include_usage:
            yield writer.event([], usage=usage(result))
    except Exception:  # the status line is sent: report the error in the stream, as OpenAI does
        log.exception("generation failed while streaming")
        yield _STREAM_ERROR
    finally:
        if not task.done():  # the client disconnected (Starlette cancelled this response): stop generating
            task.cancel()
    yield "data: [DONE]\n\n"

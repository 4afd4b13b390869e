"""FastAPI service over the exported model (models/merged by default).

    make serve                      # uvicorn agentrl.serve:app on 127.0.0.1:8000
    make serve PORT=8123 MODEL=models/merged

Routes: POST /generate, POST /v1/chat/completions (OpenAI-compatible: messages, max_tokens /
max_completion_tokens, temperature, top_p, stop, seed, n=1, stream with stream_options.include_usage, and
client-side function calling: tools, tool_choice, parallel_tool_calls; see openai_tools.py), GET /v1/models,
GET /v1/models/{id}, GET /health.

How a request flows:
  1. BodyLimit (ASGI middleware) refuses bodies over MAX_REQUEST_BYTES with 413 before anything parses them.
  2. The pydantic request models validate every field: finite numbers in sane ranges, valid Unicode (no lone
     surrogates), roles system|developer|user|assistant|tool; an unknown field (response_format, ...) is
     refused naming it. Errors on /v1 routes have OpenAI's shape {"error": {"message", "type", "param", "code"}}.
  3. `Engine.prompt` tokenizes on a tokenizer thread (never on the event loop): the chat template's own
     pieces are tokenized with their control tokens, each message's content as plain text, so
     `<|im_start|>` typed by a user is text, never a turn boundary.
  4. `complete()` is the one place a route asks for generation. Jobs go to one worker that micro-batches
     them (serve.max_batch_size, serve.batch_wait_ms) and runs them on one model thread, so the model is
     never used by two threads at once; per job it honours max_tokens, stop strings and, when streaming,
     sends the text as it is generated. Without `tools` in the request the policy's calls run server-side
     (agent.generate_with_tools with the agent.* toolset); with `tools` generation stops at the policy's
     call and the reply carries it as `tool_calls` for the client to run.
  5. A client that disconnects cancels its job: a queued job is dropped, a running one ends at its next token
     (streaming: Starlette cancels the response; plain: a watcher on the ASGI receive channel).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional, Union

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .agent import generate_with_tools
from .answers import find_answer
from .config import AgentParams, ServeParams, load_params
from .openai_tools import (
    Body,
    MessageToolCall,
    Text,
    ToolChoice,
    ToolPlan,
    ToolRequestError,
    Tools,
    control_token_in,
    open_inline_call,
    parse_calls,
    plan_tools,
    render_conversation,
    safe_prefix,
)
from .tools import toolset_from_params

MAX_REQUEST_BYTES = 1 << 20  # 1 MiB: far above any prompt that fits a model context, far below harm
MIN_TEMPERATURE = 1e-2  # below this, sampling is greedy decoding (its limit; tiny values overflow logits)
MAX_STOP = 4  # as OpenAI
MAX_CALLS = 128  # tool calls in one assistant message
DEFAULT_MAX_TOKENS = 256
log = logging.getLogger("agentrl.serve")


# ----------------------------------------------------------------------------- request models
Temperature = Annotated[
    float, Field(ge=0.0, le=2.0, description=f"0 = greedy; values below {MIN_TEMPERATURE} decode greedily too")
]


class GenerateRequest(Body):
    text: Text = Field(description="the problem / user message")
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, description="tokens to generate, 1..serve.max_tokens_limit")
    temperature: Temperature = 0.0


class ToolCall(BaseModel):
    name: str
    arguments: dict
    result: str
    ok: bool


class GenerateResponse(BaseModel):
    text: str  # the completion, tool results included (e.g. "48/2=<<48/2=24>>24 ...")
    answer: Optional[str]
    confidence: float
    tokens: int
    tool_calls: list[ToolCall] = []  # each call the server ran for this completion, in order


class TextPart(Body):
    type: Literal["text"]
    text: Text


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: OpenAI's newer system
    content: Union[Text, list[TextPart], None] = None  # absent/null only in an assistant message with tool_calls
    tool_calls: Optional[Annotated[list[MessageToolCall], Field(min_length=1, max_length=MAX_CALLS)]] = None
    tool_call_id: Optional[Annotated[Text, Field(min_length=1, max_length=256)]] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(Body):
    include_usage: bool = False


class ChatRequest(Body):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[
        None,
        Annotated[Text, Field(min_length=1)],
        Annotated[list[Annotated[Text, Field(min_length=1)]], Field(max_length=MAX_STOP)],
    ] = None
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    logprobs: Optional[bool] = None
    user: Optional[str] = None  # an end-user id (OpenAI); not recorded
    tools: Optional[Tools] = None  # functions the client runs (openai_tools.py); absent: calls run server-side
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None


# ------------------------------------------------------------------------------------ errors
class ApiError(Exception):
    """A client error naming the offending field (`param`), rendered per route (plain or OpenAI shape)."""

    def __init__(self, param: str, message: str, status: int = 422, code: Optional[str] = None):
        super().__init__(message)
        self.param, self.message, self.status, self.code = param, message, status, code


def _clean(s: Any, limit: int = 200) -> str:
    """A string safe to put in a JSON error: valid UTF-8 (surrogates escaped), bounded length."""
    s = str(s)
    s = s if len(s) <= limit else s[:limit] + "..."
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _is_openai(request: Request) -> bool:
    return request.url.path.startswith("/v1/")


def error_response(
    request: Request, status: int, errors: list[dict], code: Optional[str] = None, headers: Optional[dict] = None
) -> JSONResponse:
    """errors: [{"param": "messages.0.role", "message": "..."}]. /v1 routes: OpenAI's error object (validation
    errors as 400 invalid_request_error, like OpenAI); other routes: FastAPI's {"detail": [{loc, msg}]}."""
    if _is_openai(request):
        first = errors[0] if errors else {"param": None, "message": "error"}
        message = "; ".join(f"{e['param']}: {e['message']}" if e["param"] else e["message"] for e in errors)
        kind = "server_error" if status >= 500 else "invalid_request_error"
        status = 400 if status == 422 else status
        body = {
            "error": {
                "message": _clean(message, 2000),
                "type": kind,
                "param": _clean(first["param"]) if first["param"] else None,
                "code": code,
            }
        }
    else:
        body = {
            "detail": [
                {
                    "loc": ["body", *(_clean(first) for first in str(e["param"]).split("."))] if e["param"] else [],
                    "msg": _clean(e["message"], 2000),
                }
                for e in errors
            ]
        }
    return JSONResponse(body, status_code=status, headers=headers)


def _field_path(loc) -> Optional[str]:
    """'messages.0.role' from pydantic's loc, without the body prefix and the union-member tags it inserts
    ('str', 'list[TextPart]', 'function-after[...]')."""
    parts = [
        str(x)
        for x in loc
        if isinstance(x, int) or (x != "body" and x.isidentifier() and x not in ("str", "int", "float", "bool", "list"))
    ]
    return ".".join(_clean(x, 60) for x in parts) or None


def _describe(err: dict) -> dict:
    param = _field_path(err.get("loc", ()))
    if err["type"] == "extra_forbidden":
        msg = "not supported by this server (unknown or unsupported field)"
    elif err["type"] in ("json_invalid", "json_type"):
        msg = "request body is not valid JSON"
    elif err["type"] == "finite_number":
        msg = "must be a finite number (NaN and Infinity are not numbers)"
    elif err["type"] == "value_error" and "error" in (err.get("ctx") or {}):
        msg = str(err["ctx"]["error"])  # our validators' own message, without pydantic's "Value error, "
    else:
        msg = err.get("msg", "invalid value")
    return {"param": param, "message": msg}


def _dedupe(errors: list[dict]) -> list[dict]:
    """A union (content, stop) reports one error per alternative: keep the first per field."""
    seen, out = set(), []
    for e in errors:
        if e["param"] not in seen:
            seen.add(e["param"])
            out.append(e)
    return out[:10]


# ----------------------------------------------------------------------------- size limit
class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` (declared or streamed) gets 413 before any parsing."""

    def __init__(self, app, max_bytes: int = MAX_REQUEST_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._too_large(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(chunk)
            more = msg.get("more_body", False)
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        request = Request(scope)
        resp = error_response(
            request,
            413,
            [{"param": None, "message": f"request body larger than {self.max_bytes} bytes"}],
            code="request_too_large",
            headers={"connection": "close"},
        )
        await resp(scope, receive, send)


# -------------------------------------------------------------------------------- prompts
def chat_prompt_ids(tokenizer, messages: list[dict], template_kwargs: Optional[dict] = None) -> list[int]:
    """Token ids of a chat prompt where message contents can never become control tokens.

    The chat template is rendered with a unique marker in place of each content; the template's own
    text between markers is tokenized normally (its <|im_start|> etc. are control tokens), each content
    with split_special_tokens=True (a user's `<|im_start|>` is plain text). A template that rewrites
    contents (so markers do not come back verbatim) falls back to tokenizing the rendered prompt,
    refusing content that spells a special token."""
    tag = uuid.uuid4().hex
    # an empty content keeps its place (a template tests it: an assistant turn of tool calls only)
    marks = [f"\x00{tag}:{i}\x00" if m["content"] else "" for i, m in enumerate(messages)]
    kw = template_kwargs or {}  # e.g. the tools a chat-format policy is told about
    rendered = tokenizer.apply_chat_template(
        [{**m, "content": mk} for m, mk in zip(messages, marks)], add_generation_prompt=True, tokenize=False, **kw
    )
    pieces, pos = [], 0
    for mk in marks:
        if not mk:
            pieces.append("")
            continue
        at = rendered.find(mk, pos)
        if at < 0 or rendered.count(mk) != 1:
            return _fallback_prompt_ids(tokenizer, messages, kw)
        pieces.append(rendered[pos:at])
        pos = at + len(mk)
    ids: list[int] = []
    for piece, m in zip(pieces, messages):
        if piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
        if m["content"]:
            ids += tokenizer.encode(m["content"], add_special_tokens=False, split_special_tokens=True)
    if rendered[pos:]:
        ids += tokenizer.encode(rendered[pos:], add_special_tokens=False)
    return ids


def _fallback_prompt_ids(tokenizer, messages: list[dict], template_kwargs: Optional[dict] = None) -> list[int]:
    specials = [t for t in tokenizer.all_special_tokens if t]
    for i, m in enumerate(messages):
        hit = next((t for t in specials if t in m["content"]), None)
        if hit:
            raise ApiError(
                f"messages.{i}.content",
                f"contains the control token {hit!r}, which this model's chat template cannot keep as plain text",
            )
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )
    return tokenizer.encode(text, add_special_tokens=False)


# -------------------------------------------------------------------------------- generation
@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 0.0  # < MIN_TEMPERATURE: greedy
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def batch_key(self) -> tuple:
        """Jobs that may share one generate call. A seeded job runs alone, so its output depends only on
        its seed (and the prompt), not on what it happened to be batched with."""
        if self.greedy:
            return ("greedy",)
        return ("sample", self.temperature, self.top_p, None if self.seed is None else ("seeded", id(self)))


def served_row(tok, prompt_ids: list[int]) -> dict:
    """The row an environment episode is reset with for a served prompt: the last user turn's text as
    `question` (countdown and gridworld read their instance from it)."""
    text = tok.decode(prompt_ids, skip_special_tokens=False)
    user = text.rpartition("<|im_start|>user\n")[2].partition("<|im_end|>")[0]
    return {"question": user or text}


@dataclass
class Job:
    prompt_ids: list[int]
    sampling: Sampling
    future: asyncio.Future
    on_text: Optional[Callable[[str], None]] = None  # called (on the event loop) with each new piece of text
    sent: str = ""
    server_tools: bool = True  # run the policy's calls (agent.* toolset); False: plain generation
    stop_at_call: bool = False  # end at an opened inline call (`<<expr=`), which the client runs
    prefix: str = ""  # text the assistant turn was started with (in the prompt): a forced call opener
    cancelled: bool = False  # the client is gone: dropped from the queue, ended at its next token

    def batch_key(self) -> tuple:
        return (self.sampling.batch_key(), self.server_tools)


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class Engine:
    """Holds the model and tokenizers; batches jobs; computes answer confidences from token probabilities."""

    def __init__(self, model_path: str, cfg: ServeParams, agent: Optional[AgentParams] = None):
        from transformers import AutoModelForCausalLM

        from .modeling import load_tokenizer

        self.path, self.cfg = model_path, cfg
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if self.device == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
        # two tokenizer objects: requests are encoded on the tokenizer thread while the model thread decodes
        self.encoder, self.tokenizer = load_tokenizer(model_path), load_tokenizer(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        self.context = int(getattr(self.model.config, "max_position_embeddings", 4096))
        # the tools the policy was trained with (params.yaml agent.*): calls run server-side, in the same loop
        # as GRPO rollouts and evaluation, bounded by agent.max_tool_calls and agent.max_expression_chars
        self.toolset = toolset_from_params(agent or AgentParams(), self.tokenizer.eos_token)
        self.template_kwargs = self.toolset.chat_template_kwargs() if self.toolset else {}
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.model_pool = ThreadPoolExecutor(1, thread_name_prefix="generate")
        self.format = (agent or AgentParams()).format  # the policy's call syntax (client-side tools map to it)
        self.batches = 0
        self.tokens_generated = 0  # tokens the model sampled, all requests (tool tokens excluded)
        self.jobs_cancelled = 0  # jobs of clients that disconnected, dropped or ended early

    # ---- prompts (tokenizer thread)
    async def prompt(
        self,
        messages: list[dict],
        max_tokens: int,
        field_text: str,
        template_kwargs: Optional[dict] = None,
        continuation: tuple[tuple[str, bool], ...] = (),
        prefix: str = "",
    ) -> list[int]:
        """Validated prompt ids for `messages`, tokenized off the event loop. `template_kwargs` replace the
        server toolset's (client-side tools); `continuation` ((text, is_model_text) segments) continues an
        open assistant turn, each segment tokenized on its own as the tool loop does, as plain text; `prefix`
        starts the assistant's new text."""
        if not 1 <= max_tokens <= self.cfg.max_tokens_limit:
            raise ApiError("max_tokens", f"must be between 1 and {self.cfg.max_tokens_limit}, got {max_tokens}")
        kw = self.template_kwargs if template_kwargs is None else template_kwargs

        def encode() -> list[int]:
            ids = chat_prompt_ids(self.encoder, messages, kw)
            for text, _model in continuation:
                ids += self.encoder.encode(text, add_special_tokens=False, split_special_tokens=True)
            if prefix:
                ids += self.encoder.encode(prefix, add_special_tokens=False)
            return ids

        ids = await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, encode)
        if len(ids) + max_tokens > self.context:
            raise ApiError(
                field_text,
                f"input is {len(ids)} tokens; with max_tokens={max_tokens} it exceeds the model "
                f"context of {self.context} tokens",
                status=413,
                code="context_length_exceeded",
            )
        return ids

    # ---- generation (model thread)
    def until_eos(self, ids: list[int]) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return ids[: ids.index(eos)] if eos in ids else ids

    def send_text(self, job: Job, text: str, loop) -> None:
        if job.on_text and len(text) > len(job.sent) and text.startswith(job.sent):
            piece, job.sent = text[len(job.sent) :], text
            loop.call_soon_threadsafe(job.on_text, piece)

    def run_batch(self, jobs: list[Job], loop) -> list[dict]:
        """One tool loop (agent.generate_with_tools) for jobs sharing a batch key; each job ends at its own
        eos / max_tokens / stop string / opened call (client-side tools) or when its client is gone; streaming
        jobs get their text (server-side tool results included) as it grows."""
        tok = self.tokenizer
        s = jobs[0].sampling
        stopped_by: dict[int, int] = {}  # job -> tokens it took to produce a stop string
        called: set[int] = set()  # jobs that ended at an opened inline call

        def hook(i: int, _sample: int, completion_ids: list[int]) -> bool:
            job = jobs[i]
            if job.cancelled:
                return True
            watch_call = job.stop_at_call and "=" in tok.decode(completion_ids[-1:], skip_special_tokens=True)
            if not (job.sampling.stop or job.on_text or watch_call):
                return False
            text = tok.decode(self.until_eos(completion_ids), skip_special_tokens=True)
            if watch_call and open_inline_call(job.prefix + text) is not None:
                called.add(i)
                return True
            text, stopped = _cut_at_stop(text, job.sampling.stop)
            if stopped:
                stopped_by[i] = len(completion_ids)
                return True
            if job.on_text:
                # hold back what could still become a stop string, and an unfinished UTF-8 sequence
                hold = max((len(x) - 1 for x in job.sampling.stop), default=0)
                self.send_text(job, (text[: len(text) - hold] if hold else text).rstrip("\ufffd"), loop)
            return False

        rolls = generate_with_tools(
            self.model,
            tok,
            [j.prompt_ids for j in jobs],
            self.toolset if jobs[0].server_tools else None,
            [j.sampling.max_tokens for j in jobs],
            batch_size=len(jobs),
            temperature=0.0 if s.greedy else s.temperature,
            top_p=s.top_p,
            seed=s.seed if not s.greedy else None,
            return_logprobs=True,
            row_hook=hook,
            rows=[served_row(tok, j.prompt_ids) for j in jobs] if getattr(self.toolset, "environment", None) else None,
        )
        results = []
        for i, job in enumerate(jobs):
            roll = rolls[i][0]
            toks, lp = roll.completion_ids, roll.logprobs
            finish = "length" if roll.finish_reason in ("length", "tool_limit") else "stop"
            if tok.eos_token_id in toks:
                n = toks.index(tok.eos_token_id)
                toks, lp = toks[:n], lp[:n]
            text = tok.decode(toks, skip_special_tokens=True)
            if job.sampling.stop:
                cut, stopped = _cut_at_stop(text, job.sampling.stop)
                if stopped:
                    k = stopped_by.get(i) or next(
                        k
                        for k in range(1, len(toks) + 1)
                        if _cut_at_stop(tok.decode(toks[:k], skip_special_tokens=True), job.sampling.stop)[1]
                    )
                    toks, lp, text, finish = toks[:k], lp[:k], cut, "stop"
            if not job.stop_at_call or i not in called:
                self.send_text(job, text, loop)  # (a call's text is the client's to run, not content)
            r = self._result(toks, lp, text, finish, len(job.prompt_ids))
            r["tool_calls"] = [
                {"name": c["name"], "arguments": c["arguments"], "result": c["result"], "ok": c["ok"]}
                for c in roll.calls
            ]
            r["called"] = i in called
            results.append(r)
            self.tokens_generated += sum(roll.env_mask)
            self.jobs_cancelled += job.cancelled
        self.batches += 1
        return results

    def _result(self, ids: list[int], logprobs: list[float], text: str, finish: str, prompt_tokens: int) -> dict:
        tok = self.tokenizer
        answer, span = find_answer(text)
        # tokens whose decoded characters overlap the answer's characters
        chosen, prev = [], 0
        for k in range(len(ids)):
            end = len(tok.decode(ids[: k + 1], skip_special_tokens=True))
            if span is None or (prev < span[1] and end > span[0]):
                chosen.append(logprobs[k])
            prev = end
        finite = [x for x in chosen if x is not None and math.isfinite(x)]  # tool tokens (None) were not sampled
        confidence = math.exp(sum(finite) / len(finite)) if finite else 0.0
        return {
            "text": text,
            "answer": answer,
            "confidence": min(1.0, confidence),
            "tokens": len(ids),
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
        }

    async def worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self.queue.get()
            batch = [first]
            deadline = loop.time() + self.cfg.batch_wait_ms / 1000
            while len(batch) < self.cfg.max_batch_size:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), timeout))
                except asyncio.TimeoutError:
                    break
            groups: dict[tuple, list[Job]] = {}
            for j in batch:
                if j.cancelled:  # its client disconnected while it waited
                    self.jobs_cancelled += 1
                    continue
                groups.setdefault(j.batch_key(), []).append(j)
            for jobs in groups.values():
                try:
                    results = await loop.run_in_executor(self.model_pool, self.run_batch, jobs, loop)
                    for j, r in zip(jobs, results):
                        if not j.future.done():
                            j.future.set_result(r)
                except Exception as e:  # surfaced to each waiting request
                    log.exception("generation failed")
                    for j in jobs:
                        if not j.future.done():
                            j.future.set_exception(e)

    async def submit(self, job: Job, request: Optional[Request] = None) -> dict:
        """The job's result. Cancelling the caller (a streaming client that disconnected) or the client
        disconnecting (`request` given: a plain request) marks the job cancelled, so it stops using the model."""
        await self.queue.put(job)
        watcher = asyncio.ensure_future(_disconnected(request)) if request is not None else None
        try:
            if watcher is None:
                return await job.future
            await asyncio.wait({job.future, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if job.future.done() or watcher.exception() is not None:  # (a channel that failed: just wait)
                return await job.future
            raise ClientGone()
        except (asyncio.CancelledError, ClientGone):
            job.cancelled = True
            raise
        finally:
            if watcher is not None:
                watcher.cancel()


class ClientGone(Exception):
    """The client of a plain request disconnected before its completion was ready."""


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is read: the ASGI channel has nothing else to say)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def complete(
    engine: Engine,
    prompt_ids: list[int],
    sampling: Sampling,
    on_text: Optional[Callable[[str], None]] = None,
    request: Optional[Request] = None,
    plan: Optional[ToolPlan] = None,
) -> dict:
    """The one generation entry point of the routes: a completion for a tokenized chat prompt.

    Returns {text, answer, confidence, tokens, finish_reason, prompt_tokens, tool_calls (run server-side),
    called}; `on_text` receives the text as it is generated (streaming). With `plan` (client-side tools) the
    policy's calls are not run: an inline call ends the completion (`called`). `request`: a plain request,
    watched for its client disconnecting (ClientGone)."""
    job = Job(
        prompt_ids,
        sampling,
        asyncio.get_running_loop().create_future(),
        on_text,
        server_tools=plan is None,
        stop_at_call=plan is not None and plan.fmt == "inline" and plan.parses_calls,
        prefix=plan.prefix if plan is not None else "",
    )
    return await engine.submit(job, request)


# -------------------------------------------------------------------------------------- app
def _settings() -> tuple[str, ServeParams, AgentParams]:
    params_file = os.environ.get("AGENTRL_PARAMS", "params.yaml")
    params = load_params(params_file) if os.path.exists(params_file) else None
    cfg, agent = (params.serve, params.agent) if params else (ServeParams(), AgentParams())
    return os.environ.get("AGENTRL_MODEL_PATH", cfg.model_path), cfg, agent


def check_model_dir(path: str) -> None:
    """The server serves a local model directory only: a missing one is named, never looked up on the hub."""
    source = "AGENTRL_MODEL_PATH" if "AGENTRL_MODEL_PATH" in os.environ else "serve.model_path"
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(
            f"{source}={path}: model directory not found (run `dvc repro export` for "
            f"models/merged, or point {source} at a saved model directory)"
        )
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{source}={path}: not a saved model directory (no config.json)")


@asynccontextmanager
async def lifespan(app: FastAPI):
    path, cfg, agent = _settings()
    check_model_dir(path)
    engine = Engine(path, cfg, agent)
    app.state.engine = engine
    task = asyncio.create_task(engine.worker())
    yield
    task.cancel()
    engine.tokenize_pool.shutdown(wait=False, cancel_futures=True)
    engine.model_pool.shutdown(wait=False, cancel_futures=True)


app = FastAPI(title="agentrl", lifespan=lifespan)
app.add_middleware(BodyLimit, max_bytes=MAX_REQUEST_BYTES)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    return error_response(request, 422, _dedupe([_describe(e) for e in exc.errors()]))


@app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError):
    return error_response(request, exc.status, [{"param": exc.param, "message": exc.message}], code=exc.code)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    return error_response(
        request,
        exc.status_code,
        [{"param": None, "message": _clean(exc.detail)}],
        headers=getattr(exc, "headers", None),
    )


@app.exception_handler(ClientGone)
async def _client_gone(request: Request, exc: ClientGone):
    return Response(status_code=499)  # nobody reads it: the client disconnected (nginx's 499)


@app.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception):
    log.exception("unhandled error")
    return error_response(request, 500, [{"param": None, "message": "internal server error"}])


def _engine(request: Request) -> Engine:
    return request.app.state.engine


@app.get("/health")
async def health(request: Request):
    e = _engine(request)
    return {
        "status": "ok",
        "model_loaded": e.model is not None,
        "model_path": e.path,
        "device": e.device,
        "context": e.context,
        "batches_run": e.batches,
        "tokens_generated": e.tokens_generated,
        "jobs_cancelled": e.jobs_cancelled,
    }


def _model_card(e: Engine) -> dict:
    config = Path(e.path) / "config.json"
    return {
        "id": e.path,  # the served model directory (the `model` of a request is not checked against it)
        "object": "model",
        "created": int(config.stat().st_mtime) if config.exists() else 0,
        "owned_by": "agentrl",
        "max_model_len": e.context,
        "tool_call_format": e.format,
    }


@app.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [_model_card(_engine(request))]}


@app.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    card = _model_card(_engine(request))
    if model_id != card["id"]:
        raise ApiError(
            "model",
            f"the model {model_id!r} does not exist; this server serves {card['id']!r}",
            404,
            code="model_not_found",
        )
    return card


@app.post("/generate", response_model=GenerateResponse)
async def generate(req: GenerateRequest, request: Request):
    e = _engine(request)
    if not req.text.strip():
        raise ApiError("text", "must be a non-empty string")
    ids = await e.prompt([{"role": "user", "content": req.text}], req.max_tokens, "text")
    r = await complete(e, ids, Sampling(req.max_tokens, req.temperature), request=request)
    return GenerateResponse(
        text=r["text"], answer=r["answer"], confidence=r["confidence"], tokens=r["tokens"], tool_calls=r["tool_calls"]
    )


def _chat_sampling(req: ChatRequest, e: Engine) -> Sampling:
    if req.n not in (None, 1):
        raise ApiError("n", f"only n=1 is supported, got {req.n}")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise ApiError(name, "not supported by this server (only 0)")
    if req.logprobs:
        raise ApiError("logprobs", "not supported by this server")
    if req.stream_options is not None and not req.stream:
        raise ApiError("stream_options", "only allowed with stream=true")
    which = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, e.cfg.max_tokens_limit)
    if not 1 <= max_tokens <= e.cfg.max_tokens_limit:
        raise ApiError(which, f"must be between 1 and {e.cfg.max_tokens_limit}, got {max_tokens}")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return Sampling(max_tokens, req.temperature or 0.0, req.top_p or 1.0, req.seed, stop)


def _chat_messages(req: ChatRequest) -> list[dict]:
    """The request's messages as dicts ({role, content, tool_calls, tool_call_id}), each checked for the fields
    its role allows; `developer` is rendered as `system`."""
    out = []
    for i, m in enumerate(req.messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise ApiError(f"messages.{i}.content", "required (only an assistant message with tool_calls may omit it)")
        if m.tool_calls and m.role != "assistant":
            raise ApiError(f"messages.{i}.tool_calls", "only an assistant message carries tool calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise ApiError(f"messages.{i}.tool_call_id", "only a tool message answers a tool call")
        content = m.text()
        if not content.strip() and m.role != "assistant":
            raise ApiError(f"messages.{i}.content", "must be non-empty")
        out.append(
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": content,
                "tool_calls": [c.model_dump() for c in m.tool_calls] if m.tool_calls else None,
                "tool_call_id": m.tool_call_id,
            }
        )
    if out[-1]["role"] == "assistant":
        raise ApiError(
            f"messages.{len(out) - 1}.role",
            "the last message must not be the assistant's (continuing an assistant message is not supported)",
        )
    return out


async def _chat_prompt(e: Engine, req: ChatRequest, sampling: Sampling, plan: Optional[ToolPlan]) -> list[int]:
    """Prompt ids of a chat request: the plain template rendering, or (tools in the request or tool calls in its
    history) the conversation rendered in the policy's call format (openai_tools.render_conversation)."""
    messages = _chat_messages(req)
    if plan is None and not any(m["tool_calls"] or m["tool_call_id"] is not None for m in messages):
        return await e.prompt(
            [{"role": m["role"], "content": m["content"]} for m in messages], sampling.max_tokens, "messages"
        )
    try:
        rendered, continuation = render_conversation(messages, e.format)
    except ToolRequestError as x:
        raise ApiError(x.param, x.message) from None
    kw = None
    if plan is not None and e.format == "chat":
        kw = {**e.template_kwargs, "tools": plan.template_tools()}
    if e.format == "chat":  # what the template renders itself (tools, call arguments) must not spell control tokens
        specials = [t for t in e.encoder.all_special_tokens if t]
        for where, value in [("tools", plan.template_tools() if plan else [])] + [
            (f"messages.{i}.tool_calls", m["tool_calls"]) for i, m in enumerate(messages) if m["tool_calls"]
        ]:
            hit = control_token_in(value, specials)
            if hit:
                raise ApiError(
                    where, f"contains the control token {hit!r}, which the chat template would not keep as text"
                )
    return await e.prompt(
        rendered, sampling.max_tokens, "messages", kw, tuple(continuation), plan.prefix if plan is not None else ""
    )


@app.post("/v1/chat/completions")
async def chat(req: ChatRequest, request: Request):
    e = _engine(request)
    sampling = _chat_sampling(req, e)
    try:
        plan = plan_tools(e.format, req.tools, req.tool_choice, req.parallel_tool_calls)
    except ToolRequestError as x:
        raise ApiError(x.param, x.message) from None
    ids = await _chat_prompt(e, req, sampling, plan)
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), req.model or e.path
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(e, ids, sampling, cid, created, model, include_usage, plan),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache"},
        )
    r = await complete(e, ids, sampling, request=request, plan=plan)
    message: dict = {"role": "assistant", "content": r["text"]}
    finish = r["finish_reason"]
    if plan is not None:
        content, calls = parse_calls(plan.prefix + r["text"], plan, r["called"])
        message["content"] = content
        if calls:
            message["tool_calls"], finish = calls, "tool_calls"
    return JSONResponse(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": _usage(r),
            "answer": r["answer"],
            "confidence": r["confidence"],
            "tool_calls": r["tool_calls"],  # the calls the server ran (their results are in the content)
        }
    )


def _usage(r: dict) -> dict:
    return {
        "prompt_tokens": r["prompt_tokens"],
        "completion_tokens": r["tokens"],
        "total_tokens": r["prompt_tokens"] + r["tokens"],
    }


async def _stream(
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
            yield event([], usage=_usage(r))
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

"""The HTTP surface: the FastAPI app, its routes and the model's lifetime.

Routes: POST /generate, POST /v1/chat/completions (OpenAI-compatible, streaming in streaming.py, client-side
function calling in openai_tools.py), GET /v1/models, GET /v1/models/{id}, GET /health. A route validates what
pydantic cannot (schema.py), tokenizes through `Engine.prompt` and asks `complete()` for the completion
(engine.py); errors are rendered by errors.py."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..common import torch_dtype
from ..config import AgentParams, ModelParams, ServeParams, load_params
from ..modeling import export_check_problem
from .engine import Engine, Sampling, complete
from .errors import HANDLERS, MAX_REQUEST_BYTES, ApiError, BodyLimit
from .openai_tools import ToolPlan, ToolRequestError, control_token_in, parse_calls, plan_tools, render_conversation
from .schema import DEFAULT_MAX_TOKENS, ChatRequest, GenerateRequest, GenerateResponse, usage
from .streaming import chat_stream


def _settings() -> tuple[str, ServeParams, AgentParams, ModelParams, dict]:
    params_file = os.environ.get("AGENTRL_PARAMS", "params.yaml")
    if not os.path.exists(params_file):  # params.yaml is the one place the settings live (no schema defaults)
        source = "AGENTRL_PARAMS" if "AGENTRL_PARAMS" in os.environ else "params.yaml"
        raise FileNotFoundError(
            f"{source}={params_file}: no params file; the server reads serve.*, agent.* (the tool loop the model "
            "was trained with) and model.* from it: run from the repository or set AGENTRL_PARAMS"
        )
    params = load_params(params_file)
    cfg, agent, model = params.serve, params.agent, params.model
    return os.environ.get("AGENTRL_MODEL_PATH", cfg.model_path), cfg, agent, model, params.environments


def check_model_dir(path: str) -> None:
    """The server serves a local model directory or GGUF file only: a missing one is named, never looked up on the
    hub."""
    source = "AGENTRL_MODEL_PATH" if "AGENTRL_MODEL_PATH" in os.environ else "serve.model_path"
    directory = Path(path)
    if path.endswith(".gguf"):  # a GGUF file (export.gguf writes models/gguf/model-<type>.gguf)
        if not directory.is_file():
            raise FileNotFoundError(f"{source}={path}: GGUF file not found (export.gguf writes models/gguf/)")
        return
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{source}={path}: model directory not found (run `dvc repro export` for "
            f"models/merged, or point {source} at a saved model directory)"
        )
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{source}={path}: not a saved model directory (no config.json)")
    if problem := export_check_problem(directory):  # export swaps in only verified models; this is another copy
        raise ValueError(f"{source}={path}: {problem}")


@asynccontextmanager
async def lifespan(app: FastAPI):
    """Loads the model once at startup (as evaluation loads it); at shutdown stops the worker and its thread pools."""
    path, cfg, agent, model, environments = _settings()
    check_model_dir(path)
    engine = Engine(path, cfg, agent, torch_dtype(model.precision), environments)  # as evaluation loads it
    app.state.engine = engine
    task = asyncio.create_task(engine.worker())
    yield
    task.cancel()
    engine.tokenize_pool.shutdown(wait=False, cancel_futures=True)
    engine.model_pool.shutdown(wait=False, cancel_futures=True)


app = FastAPI(title="agentrl", lifespan=lifespan, exception_handlers=HANDLERS)
app.add_middleware(BodyLimit, max_bytes=MAX_REQUEST_BYTES)


def _engine(request: Request) -> Engine:
    return request.app.state.engine


@app.get("/health")
async def health(request: Request):
    """`GET /health`: the model, its device and dtype, and the engine's counters."""
    engine = _engine(request)
    return {
        "status": "ok",
        "model_loaded": engine.model is not None,
        "model_path": engine.path,
        "device": engine.model.device.type,
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "context": engine.context,
        "batches_run": engine.batches,
        "tokens_generated": engine.tokens_generated,
        "jobs_cancelled": engine.jobs_cancelled,
    }


def _model_card(engine: Engine) -> dict:
    config = Path(engine.path) / "config.json"
    return {
        "id": engine.path,  # the served model directory (the `model` of a request is not checked against it)
        "object": "model",
        "created": int(config.stat().st_mtime) if config.exists() else 0,
        "owned_by": "agentrl",
        "max_model_len": engine.context,
        "tool_call_format": engine.format,
    }


@app.get("/v1/models")
async def list_models(request: Request):
    """`GET /v1/models`: the one model served."""
    return {"object": "list", "data": [_model_card(_engine(request))]}


@app.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    """`GET /v1/models/{id}`."""
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
    """`POST /generate`: one problem in, the completion with its tool calls and the parsed answer out."""
    engine = _engine(request)
    if not req.text.strip():
        raise ApiError("text", "must be a non-empty string")
    ids = await engine.prompt([{"role": "user", "content": req.text}], req.max_tokens, "text")
    result = await complete(engine, ids, Sampling(req.max_tokens, req.temperature), request=request)
    return GenerateResponse(
        text=result["text"],
        answer=result["answer"],
        confidence=result["confidence"],
        tokens=result["tokens"],
        tool_calls=result["tool_calls"],
    )


def _chat_sampling(req: ChatRequest, engine: Engine) -> Sampling:
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
        max_tokens = min(DEFAULT_MAX_TOKENS, engine.cfg.max_tokens_limit)
    if not 1 <= max_tokens <= engine.cfg.max_tokens_limit:
        raise ApiError(which, f"must be between 1 and {engine.cfg.max_tokens_limit}, got {max_tokens}")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return Sampling(max_tokens, req.temperature or 0.0, req.top_p or 1.0, req.seed, stop)


def _chat_messages(req: ChatRequest) -> list[dict]:
    """The request's messages as dicts ({role, content, tool_calls, tool_call_id}), each checked for the fields
    its role allows; `developer` is rendered as `system`."""
    out = []
    for index, message in enumerate(req.messages):
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise ApiError(
                f"messages.{index}.content", "required (only an assistant message with tool_calls may omit it)"
            )
        if message.tool_calls and message.role != "assistant":
            raise ApiError(f"messages.{index}.tool_calls", "only an assistant message carries tool calls")
        if message.tool_call_id is not None and message.role != "tool":
            raise ApiError(f"messages.{index}.tool_call_id", "only a tool message answers a tool call")
        content = message.text()
        if not content.strip() and message.role != "assistant":
            raise ApiError(f"messages.{index}.content", "must be non-empty")
        out.append(
            {
                "role": "system" if message.role == "developer" else message.role,
                "content": content,
                "tool_calls": [c.model_dump() for c in message.tool_calls] if message.tool_calls else None,
                "tool_call_id": message.tool_call_id,
            }
        )
    if out[-1]["role"] == "assistant":
        raise ApiError(
            f"messages.{len(out) - 1}.role",
            "the last message must not be the assistant's (continuing an assistant message is not supported)",
        )
    return out


async def _chat_prompt(engine: Engine, req: ChatRequest, sampling: Sampling, plan: Optional[ToolPlan]) -> list[int]:
    """Prompt ids of a chat request: the plain template rendering, or (tools in the request or tool calls in its
    history) the conversation rendered in the policy's call format (openai_tools.render_conversation)."""
    messages = _chat_messages(req)
    if plan is None and not any(m["tool_calls"] or m["tool_call_id"] is not None for m in messages):
        return await engine.prompt(
            [{"role": m["role"], "content": m["content"]} for m in messages], sampling.max_tokens, "messages"
        )
    try:
        rendered, continuation = render_conversation(messages, engine.format)
    except ToolRequestError as error:
        raise ApiError(error.param, error.message) from None
    kw = None
    if plan is not None and engine.format == "chat":
        kw = {**engine.template_kwargs, "tools": plan.template_tools()}
    if (
        engine.format == "chat"
    ):  # what the template renders itself (tools, call arguments) must not spell protocol tokens
        for where, value in [("tools", plan.template_tools() if plan else [])] + [
            (f"messages.{i}.tool_calls", m["tool_calls"]) for i, m in enumerate(messages) if m["tool_calls"]
        ]:
            hit = control_token_in(value, engine.protocol)
            if hit:
                raise ApiError(
                    where, f"contains the control token {hit!r}, which the chat template would not keep as text"
                )
    return await engine.prompt(
        rendered, sampling.max_tokens, "messages", kw, tuple(continuation), plan.prefix if plan is not None else ""
    )


@app.post("/v1/chat/completions")
async def chat(req: ChatRequest, request: Request):
    """`POST /v1/chat/completions`: OpenAI's chat API, streamed or not, with client-side function calling."""
    engine = _engine(request)
    sampling = _chat_sampling(req, engine)
    try:
        plan = plan_tools(engine.format, req.tools, req.tool_choice, req.parallel_tool_calls)
    except ToolRequestError as error:
        raise ApiError(error.param, error.message) from None
    ids = await _chat_prompt(engine, req, sampling, plan)
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), req.model or engine.path
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            chat_stream(engine, ids, sampling, cid, created, model, include_usage, plan),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache"},
        )
    result = await complete(engine, ids, sampling, request=request, plan=plan)
    message: dict = {"role": "assistant", "content": result["text"]}
    finish = result["finish_reason"]
    if plan is not None:
        content, calls = parse_calls(plan.prefix + result["text"], plan, result["called"])
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
            "usage": usage(result),
            "answer": result["answer"],
            "confidence": result["confidence"],
            "tool_calls": result["tool_calls"],  # the calls the server ran (their results are in the content)
        }
    )

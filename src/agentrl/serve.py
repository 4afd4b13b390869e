"""FastAPI service over the exported model (models/merged by default).

    make serve                      # uvicorn agentrl.serve:app on 127.0.0.1:8000
    make serve PORT=8123 MODEL=models/merged

Routes: POST /generate, POST /v1/chat/completions (OpenAI-compatible for messages, max_tokens,
temperature, n=1), GET /health. Prompts are built with the tokenizer's chat template. Concurrent
requests are micro-batched: a single worker collects up to serve.max_batch_size requests (waiting at
most serve.batch_wait_ms) and runs one batched generate, so the model is never used by two threads
at once and throughput grows with concurrency.
"""
from __future__ import annotations

import asyncio
import math
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictStr

from .config import ServeParams, load_params
from .rewards import find_answer


# ----------------------------------------------------------------------------- request models
class GenerateRequest(BaseModel):
    text: StrictStr = Field(description="the problem / user message")
    max_tokens: int = Field(256, description="tokens to generate, 1..serve.max_tokens_limit")
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 = greedy")


class GenerateResponse(BaseModel):
    text: str
    answer: Optional[str]
    confidence: float
    tokens: int


class ChatMessage(BaseModel):
    role: StrictStr
    content: StrictStr


class ChatRequest(BaseModel):
    model: Optional[str] = None
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=5.0)
    n: int = 1
    stream: bool = False


def _bad(field_name: str, msg: str, status: int = 422):
    raise HTTPException(status_code=status, detail=[{"loc": ["body", field_name], "msg": msg}])


# ----------------------------------------------------------------------------------- engine
@dataclass
class Job:
    messages: list[dict]
    max_tokens: int
    temperature: float
    future: asyncio.Future = field(default=None)  # type: ignore[assignment]


class Engine:
    """Holds the model; batches jobs; computes answer confidences from token probabilities."""

    def __init__(self, model_path: str, cfg: ServeParams):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path, self.cfg = model_path, cfg
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if self.device == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        self.context = int(getattr(self.model.config, "max_position_embeddings", 4096))
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.batches = 0

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.inference_mode()
    def run_batch(self, jobs: list[Job]) -> list[dict]:
        """One generate call for jobs sharing a temperature; each job truncated to its max_tokens."""
        tok = self.tokenizer
        texts = [tok.apply_chat_template(j.messages, add_generation_prompt=True, tokenize=False) for j in jobs]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        temp = jobs[0].temperature
        kw = dict(max_new_tokens=max(j.max_tokens for j in jobs), pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, return_dict_in_generate=True, output_scores=True)
        kw.update(dict(do_sample=True, temperature=temp, top_k=0, top_p=1.0) if temp > 0 else dict(do_sample=False))
        out = self.model.generate(**enc, **kw)
        logp = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        new = out.sequences[:, enc["input_ids"].shape[1]:]
        results = []
        for i, job in enumerate(jobs):
            ids = new[i].tolist()[: job.max_tokens]
            lp = logp[i].tolist()[: job.max_tokens]
            finish = "length"
            if tok.eos_token_id in ids:
                n = ids.index(tok.eos_token_id)
                ids, lp, finish = ids[:n], lp[:n], "stop"
            results.append(self._result(ids, lp, finish, int(enc["attention_mask"][i].sum())))
        self.batches += 1
        return results

    def _result(self, ids: list[int], logprobs: list[float], finish: str, prompt_tokens: int) -> dict:
        tok = self.tokenizer
        text = tok.decode(ids, skip_special_tokens=True)
        answer, span = find_answer(text)
        # tokens whose decoded characters overlap the answer's characters
        chosen, prev = [], 0
        for k in range(len(ids)):
            end = len(tok.decode(ids[: k + 1], skip_special_tokens=True))
            if span is None or (prev < span[1] and end > span[0]):
                chosen.append(logprobs[k])
            prev = end
        finite = [x for x in chosen if math.isfinite(x)]
        confidence = math.exp(sum(finite) / len(finite)) if finite else 0.0
        return {"text": text, "answer": answer, "confidence": min(1.0, confidence), "tokens": len(ids),
                "finish_reason": finish, "prompt_tokens": prompt_tokens}

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
            groups: dict[float, list[Job]] = {}
            for j in batch:
                groups.setdefault(j.temperature, []).append(j)
            for jobs in groups.values():
                try:
                    results = await loop.run_in_executor(None, self.run_batch, jobs)
                    for j, r in zip(jobs, results):
                        if not j.future.done():
                            j.future.set_result(r)
                except Exception as e:  # noqa: BLE001 - surfaced to each waiting request
                    for j in jobs:
                        if not j.future.done():
                            j.future.set_exception(e)

    async def submit(self, messages: list[dict], max_tokens: int, temperature: float) -> dict:
        job = Job(messages, max_tokens, temperature, asyncio.get_running_loop().create_future())
        await self.queue.put(job)
        return await job.future

    def validate(self, messages: list[dict], max_tokens: int, field_text: str) -> None:
        if max_tokens <= 0 or max_tokens > self.cfg.max_tokens_limit:
            _bad("max_tokens", f"must be between 1 and {self.cfg.max_tokens_limit}, got {max_tokens}")
        n = len(self.prompt_ids(messages))
        if n + max_tokens > self.context:
            _bad(field_text, f"input is {n} tokens; with max_tokens={max_tokens} it exceeds the model context of "
                             f"{self.context} tokens", status=413)


# -------------------------------------------------------------------------------------- app
def _settings() -> tuple[str, ServeParams]:
    cfg = load_params(os.environ.get("AGENTRL_PARAMS", "params.yaml")).serve if os.path.exists(
        os.environ.get("AGENTRL_PARAMS", "params.yaml")) else ServeParams()
    return os.environ.get("AGENTRL_MODEL_PATH", cfg.model_path), cfg


@asynccontextmanager
async def lifespan(app: FastAPI):
    path, cfg = _settings()
    engine = Engine(path, cfg)
    app.state.engine = engine
    task = asyncio.create_task(engine.worker())
    yield
    task.cancel()


app = FastAPI(title="agentrl", lifespan=lifespan)


def _engine(request: Request) -> Engine:
    return request.app.state.engine


@app.get("/health")
async def health(request: Request):
    e = _engine(request)
    return {"status": "ok", "model_loaded": e.model is not None, "model_path": e.path, "device": e.device,
            "context": e.context, "batches_run": e.batches}


@app.post("/generate", response_model=GenerateResponse)
async def generate(req: GenerateRequest, request: Request):
    e = _engine(request)
    if not req.text.strip():
        _bad("text", "must be a non-empty string")
    messages = [{"role": "user", "content": req.text}]
    e.validate(messages, req.max_tokens, "text")
    r = await e.submit(messages, req.max_tokens, req.temperature)
    return GenerateResponse(text=r["text"], answer=r["answer"], confidence=r["confidence"], tokens=r["tokens"])


@app.post("/v1/chat/completions")
async def chat(req: ChatRequest, request: Request):
    e = _engine(request)
    if req.n != 1:
        _bad("n", "only n=1 is supported")
    if req.stream:
        _bad("stream", "streaming is not supported")
    if not req.messages:
        _bad("messages", "must contain at least one message")
    if any(not m.content.strip() for m in req.messages):
        _bad("messages", "every message needs non-empty content")
    max_tokens = req.max_completion_tokens or req.max_tokens or min(256, e.cfg.max_tokens_limit)
    messages = [m.model_dump() for m in req.messages]
    e.validate(messages, max_tokens, "messages")
    r = await e.submit(messages, max_tokens, req.temperature or 0.0)
    return JSONResponse({
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
        "model": req.model or e.path,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": r["text"]},
                     "finish_reason": r["finish_reason"], "logprobs": None}],
        "usage": {"prompt_tokens": r["prompt_tokens"], "completion_tokens": r["tokens"],
                  "total_tokens": r["prompt_tokens"] + r["tokens"]},
        "answer": r["answer"], "confidence": r["confidence"],
    })

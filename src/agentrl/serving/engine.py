"""The generation engine: one model, one worker that micro-batches requests, cancellation of the jobs whose
clients left.

Prompts are tokenized on a tokenizer thread (never on the event loop): the chat template's own pieces with their
control tokens, each message's content as plain text, so `<|im_start|>` typed by a user is text, never a turn
boundary. Jobs go to one worker that groups them (serve.max_batch_size, serve.batch_wait_ms) and runs each group
on one model thread, so the model is never used by two threads at once. A group is one call of the agent's
tool loop (agent.generate_with_tools), the loop of GRPO rollouts and evaluation: without client-side tools the
policy's calls run server-side with the agent.* toolset; with them, generation ends at the policy's call. A job
whose client disconnected is dropped from the queue, or ends at its next token (Engine.submit)."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from fastapi import Request

from ..agent.loop import generate_with_tools
from ..agent.tools import toolset_from_params
from ..answers import find_answer
from ..config import AgentParams, ServeParams
from ..modeling import load_model, load_tokenizer
from .errors import ApiError, ClientGone
from .openai_tools import ToolPlan, inline_call_end
from .schema import MIN_TEMPERATURE

log = logging.getLogger(__name__)


# -------------------------------------------------------------------------------- prompts
def protocol_tokens(tokenizer) -> list[str]:
    """The text of every added token, special or not, longest first: what must never come out of a message's
    content. `split_special_tokens` splits only the special ones, but Qwen3's `<tool_call>` and
    `</tool_response>` are non-special added tokens, matched wherever they are spelled."""
    return sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.content}, key=len, reverse=True)


def _plain_pieces(text: str, protocol: Optional[re.Pattern]) -> list[str]:
    """`text` cut so that no piece spells a protocol token: each spelled one is cut after its first character
    (`a</tool_response>` -> `a<`, `/tool_response>`), so it is tokenized as the text it is."""
    if protocol is None:
        return [text]
    pieces, pos = [], 0
    while (match := protocol.search(text, pos)) is not None:
        pieces.append(text[pos : match.start() + 1])
        pos = match.start() + 1
    pieces.append(text[pos:])
    return [p for p in pieces if p]


def encode_plain(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text as plain text: never a protocol token (protocol_tokens), in one batched
    tokenizer call (linear in the total length, however many texts).

    Args:
        texts: message contents, tool results.

    Returns:
        One list of ids per text."""
    protocol = protocol_tokens(tokenizer)
    pattern = re.compile("|".join(map(re.escape, protocol))) if protocol else None
    cut = [_plain_pieces(t, pattern) for t in texts]
    flat = [p for pieces in cut for p in pieces]
    enc = tokenizer(flat, add_special_tokens=False, split_special_tokens=True)["input_ids"] if flat else []
    out, offset = [], 0
    for pieces in cut:
        out.append([i for ids in enc[offset : offset + len(pieces)] for i in ids])
        offset += len(pieces)
    return out


def chat_prompt_ids(tokenizer, messages: list[dict], template_kwargs: Optional[dict] = None) -> list[int]:
    """Token ids of a chat prompt where message contents can never become protocol tokens.

    The chat template is rendered with a unique marker in place of each content; the template's own
    text between markers is tokenized normally (its <|im_start|> etc. are control tokens), each content
    as plain text (encode_plain: a user's `<|im_start|>` or `</tool_response>` is text). The markers are found
    in one pass, so the cost is linear in the prompt (a search per message was quadratic in their number). A
    template that rewrites contents (so markers do not come back verbatim) falls back to tokenizing the
    rendered prompt, refusing content that spells a protocol token."""
    tag = uuid.uuid4().hex
    # an empty content keeps its place (a template tests it: an assistant turn of tool calls only)
    marks = [f"\x00{tag}:{i}\x00" if m["content"] else "" for i, m in enumerate(messages)]
    kw = template_kwargs or {}  # e.g. the tools a chat-format policy is told about
    rendered = tokenizer.apply_chat_template(
        [{**m, "content": mk} for m, mk in zip(messages, marks)], add_generation_prompt=True, tokenize=False, **kw
    )
    split = re.split(f"\x00{tag}:(\\d+)\x00", rendered)  # [template, index, template, index, ..., template]
    template, found = split[0::2], split[1::2]
    if found != [str(i) for i, mk in enumerate(marks) if mk]:  # each content once, in order
        return _fallback_prompt_ids(tokenizer, messages, kw)
    template_ids = tokenizer(template, add_special_tokens=False)["input_ids"]
    content_ids = encode_plain(tokenizer, [m["content"] for m in messages if m["content"]])
    ids = list(template_ids[0])
    for content, after in zip(content_ids, template_ids[1:]):
        ids += content + after
    return ids


def _fallback_prompt_ids(tokenizer, messages: list[dict], template_kwargs: Optional[dict] = None) -> list[int]:
    protocol = protocol_tokens(tokenizer)
    for index, message in enumerate(messages):
        hit = next((t for t in protocol if t in message["content"]), None)
        if hit:
            raise ApiError(
                f"messages.{index}.content",
                f"contains the control token {hit!r}, which this model's chat template cannot keep as plain text",
            )
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )
    return tokenizer.encode(text, add_special_tokens=False)


# -------------------------------------------------------------------------------- generation
@dataclass
class Sampling:
    """How one request samples (OpenAI's parameters)."""

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
    """One queued request: its prompt, sampling and the future its reply resolves."""

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

    def __init__(
        self,
        model_path: str,
        cfg: ServeParams,
        agent: AgentParams,
        dtype: torch.dtype,
        environments: Optional[dict] = None,
    ):
        self.path, self.cfg = model_path, cfg
        # two tokenizer objects: requests are encoded on the tokenizer thread while the model thread decodes
        if str(model_path).endswith(".gguf"):  # export.gguf's file (or any Llama GGUF): dequantized by transformers
            import copy

            from ..gguf_files import load_plain

            model, self.tokenizer = load_plain(Path(model_path))
            self.encoder, model = copy.deepcopy(self.tokenizer), model.to(dtype)
        else:
            self.encoder, self.tokenizer = load_tokenizer(model_path), load_tokenizer(model_path)
            model = load_model(model_path, dtype)
        self.model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
        self.context = int(getattr(self.model.config, "max_position_embeddings", 4096))
        # the most characters one token of plain text spells (its vocabulary string is at least as long; added
        # tokens never come out of a content): more than context x this many characters cannot fit (check_cost)
        added = set(self.encoder.added_tokens_decoder)
        self.longest_token = max(len(t) for t, i in self.encoder.get_vocab().items() if i not in added)
        self.protocol = protocol_tokens(self.encoder)  # added tokens, special or not: never spelled by a client
        # the tools the policy was trained with (params.yaml agent.*): calls run server-side, in the same loop
        # as GRPO rollouts and evaluation, bounded by agent.max_tool_calls and agent.max_expression_chars; a
        # built-in environment with its knobs from params.environments, as in training and evaluation
        self.toolset = toolset_from_params(agent, self.tokenizer.eos_token, environments)
        self.template_kwargs = self.toolset.chat_template_kwargs() if self.toolset else {}
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.model_pool = ThreadPoolExecutor(1, thread_name_prefix="generate")
        self.format = agent.format  # the policy's call syntax (client-side tools map to it)
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
        self.check_cost(messages, continuation, field_text)
        kw = self.template_kwargs if template_kwargs is None else template_kwargs

        def encode() -> list[int]:
            ids = chat_prompt_ids(self.encoder, messages, kw)
            for seg_ids in encode_plain(self.encoder, [text for text, _model in continuation]):
                ids += seg_ids
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

    def check_cost(self, messages: list[dict], continuation: tuple[tuple[str, bool], ...], field: str) -> None:
        """Refuses (413) a prompt that cannot fit the model context before any tokenizing, from what costs
        nothing to count: each message is at least one token, and a token spells at most `longest_token`
        characters. (The 1 MiB body limit alone let 26,000 one-character messages take the tokenizer thread.)

        Args:
            messages: the chat messages ({role, content, ...}).
            continuation: the open assistant turn's (text, is_model_text) segments.
            field: the request field named in the error."""
        most_chars = self.context * self.longest_token
        chars = sum(len(m["content"]) for m in messages) + sum(len(text) for text, _ in continuation)
        if len(messages) > self.context or chars > most_chars:
            raise ApiError(
                field,
                f"{len(messages)} messages, {chars} characters: more than the model context of {self.context} "
                f"tokens can hold (at most {self.context} messages and {most_chars} characters, since each message "
                f"is at least one token and a token spells at most {self.longest_token} characters)",
                status=413,
                code="context_length_exceeded",
            )

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
        sampling = jobs[0].sampling
        stopped_by: dict[int, int] = {}  # job -> tokens it took to produce a stop string
        called: dict[int, int] = {}  # jobs that ended at an inline call -> characters of their text up to its `=`

        def hook(index: int, _sample: int, completion_ids: list[int]) -> bool:
            job = jobs[index]
            if job.cancelled:
                return True
            watch_call = job.stop_at_call and "=" in tok.decode(completion_ids[-1:], skip_special_tokens=True)
            if not (job.sampling.stop or job.on_text or watch_call):
                return False
            text = tok.decode(self.until_eos(completion_ids), skip_special_tokens=True)
            if watch_call:
                end = inline_call_end(job.prefix + text)
                if end is not None:
                    called[index] = end - len(job.prefix)
                    return True
            text, stopped = _cut_at_stop(text, job.sampling.stop)
            if stopped:
                stopped_by[index] = len(completion_ids)
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
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed if not sampling.greedy else None,
            return_logprobs=True,
            row_hook=hook,
            rows=[served_row(tok, j.prompt_ids) for j in jobs] if getattr(self.toolset, "environment", None) else None,
        )
        results = []
        for index, job in enumerate(jobs):
            roll = rolls[index][0]
            toks, lp = roll.completion_ids, roll.logprobs
            finish = "length" if roll.finish_reason in ("length", "tool_limit") else "stop"
            if tok.eos_token_id in toks:
                eos_at = toks.index(tok.eos_token_id)
                toks, lp = toks[:eos_at], lp[:eos_at]
            text = tok.decode(toks, skip_special_tokens=True)
            if index in called:  # the call's `=` may end inside a merged token (`=<<`): what follows is not this turn's
                text = text[: called[index]]
            if job.sampling.stop:
                cut, stopped = _cut_at_stop(text, job.sampling.stop)
                if stopped:
                    kept = stopped_by.get(index) or next(
                        kept
                        for kept in range(1, len(toks) + 1)
                        if _cut_at_stop(tok.decode(toks[:kept], skip_special_tokens=True), job.sampling.stop)[1]
                    )
                    toks, lp, text, finish = toks[:kept], lp[:kept], cut, "stop"
            if not job.stop_at_call or index not in called:
                self.send_text(job, text, loop)  # (a call's text is the client's to run, not content)
            result = self._result(toks, lp, text, finish, len(job.prompt_ids))
            result["tool_calls"] = [
                {"name": c["name"], "arguments": c["arguments"], "result": c["result"], "ok": c["ok"]}
                for c in roll.calls
            ]
            result["called"] = index in called
            results.append(result)
            self.tokens_generated += sum(roll.env_mask)
            self.jobs_cancelled += job.cancelled
        self.batches += 1
        return results

    def _result(self, ids: list[int], logprobs: list[float], text: str, finish: str, prompt_tokens: int) -> dict:
        tok = self.tokenizer
        answer, span = find_answer(text)
        # tokens whose decoded characters overlap the answer's characters
        chosen, prev = [], 0
        for position in range(len(ids)):
            end = len(tok.decode(ids[: position + 1], skip_special_tokens=True))
            if span is None or (prev < span[1] and end > span[0]):
                chosen.append(logprobs[position])
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
            for job in batch:
                if job.cancelled:  # its client disconnected while it waited
                    self.jobs_cancelled += 1
                    continue
                groups.setdefault(job.batch_key(), []).append(job)
            for jobs in groups.values():
                try:
                    results = await loop.run_in_executor(self.model_pool, self.run_batch, jobs, loop)
                    for job, result in zip(jobs, results):
                        if not job.future.done():
                            job.future.set_result(result)
                except Exception as error:  # surfaced to each waiting request
                    log.exception("generation failed")
                    for job in jobs:
                        if not job.future.done():
                            job.future.set_exception(error)

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

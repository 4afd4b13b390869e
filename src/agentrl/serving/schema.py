"""The request and response bodies of the routes (pydantic): every field checked before a route runs.

Numbers are finite and in range, text is valid Unicode, roles are system|developer|user|assistant|tool, and an
unknown field (response_format, ...) is refused naming it (`Body`, openai_tools.py)."""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, Field

from .openai_tools import Body, MessageToolCall, Text, ToolChoice, Tools

MIN_TEMPERATURE = 1e-2  # below this, sampling is greedy decoding (its limit; tiny values overflow logits)
MAX_STOP = 4  # as OpenAI
MAX_CALLS = 128  # tool calls in one assistant message
DEFAULT_MAX_TOKENS = 256

Temperature = Annotated[
    float, Field(ge=0.0, le=2.0, description=f"0 = greedy; values below {MIN_TEMPERATURE} decode greedily too")
]


class GenerateRequest(Body):
    """`POST /generate`'s body."""

    text: Text = Field(description="the problem / user message")
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, description="tokens to generate, 1..serve.max_tokens_limit")
    temperature: Temperature = 0.0


class ToolCall(BaseModel):
    """One tool call the server ran during a completion."""

    name: str
    arguments: dict
    result: str
    ok: bool


class GenerateResponse(BaseModel):
    """`POST /generate`'s answer."""

    text: str  # the completion, tool results included (e.g. "48/2=<<48/2=24>>24 ...")
    answer: Optional[str]
    confidence: float
    tokens: int
    tool_calls: list[ToolCall] = []  # each call the server ran for this completion, in order


class TextPart(Body):
    """A text part of a message's content."""

    type: Literal["text"]
    text: Text


class ChatMessage(Body):
    """One message of a chat request."""

    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: OpenAI's newer system
    content: Union[Text, list[TextPart], None] = None  # absent/null only in an assistant message with tool_calls
    tool_calls: Optional[Annotated[list[MessageToolCall], Field(min_length=1, max_length=MAX_CALLS)]] = None
    tool_call_id: Optional[Annotated[Text, Field(min_length=1, max_length=256)]] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(Body):
    """OpenAI's `stream_options`."""

    include_usage: bool = False


class ChatRequest(Body):
    """`POST /v1/chat/completions`'s body."""

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


def usage(result: dict) -> dict:
    """OpenAI's `usage` of a completion result (engine.complete)."""
    return {
        "prompt_tokens": result["prompt_tokens"],
        "completion_tokens": result["tokens"],
        "total_tokens": result["prompt_tokens"] + result["tokens"],
    }

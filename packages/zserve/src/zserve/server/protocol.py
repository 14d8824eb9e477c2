"""Request/response models of the OpenAI API subset zserve serves.

Requests are validated strictly (``"5"`` is not an integer, ``"yes"`` is not a
boolean) so a wrong type is a 400 naming the field rather than a silent
coercion. `response_format` (json_object / json_schema) and `tools` / `tool_choice` are
served by constrained decoding (`zserve.structured`, `tools.py`). Nothing is silently
ignored: an OpenAI field zserve does not implement (penalties, `logit_bias`...) is a
400 naming it unless it holds its
no-op value (null, 0, an empty list, ``{"type": "text"}``: what clients send by
default, see `unsupported.py`), and a key OpenAI does not define either is a 400
("unrecognized request argument"), as OpenAI answers. ``user`` is accepted: it only
identifies the caller.

Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from zserve.config import SEED_MAX, SEED_MIN
from zserve.server.tool_protocol import (
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolCallIn,
)
from zserve.server.unsupported import check_unsupported

MAX_LOGPROBS = 20
"""Most alternatives per token (`logprobs` of completions, `top_logprobs` of chat): vLLM's
default limit; OpenAI allows 5 and 20."""

MAX_N = 16
"""Most choices per request."""


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = Field(
        default=False, description="Send a last chunk with `usage` and no choices."
    )


class _SamplingFields(_Request):
    """Sampling parameters shared by completions and chat completions."""

    model: str = Field(description="Model id as listed by `/v1/models`.")
    max_tokens: int | None = Field(
        default=None, ge=1, description="Tokens to generate at most (>= 1)."
    )
    temperature: float = Field(default=1.0, ge=0.0, description="0 (or below 1e-5) means greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus mass in (0, 1].")
    top_k: int | None = Field(default=None, description="Keep the k likeliest tokens (zserve).")
    n: int = Field(
        default=1,
        ge=1,
        le=MAX_N,
        description="Choices per request; with a seed, choice i samples with seed + i.",
    )
    stream: bool = Field(default=False, description="Send Server-Sent Events as tokens arrive.")
    stream_options: StreamOptions | None = Field(
        default=None, description="Only with stream: true."
    )
    stop: str | list[str] | None = Field(default=None, description="Stop strings (up to 4).")
    seed: int | None = Field(
        default=None,
        ge=SEED_MIN,
        le=SEED_MAX,
        description="Seed (64-bit) of this request's sampler.",
    )
    ignore_eos: bool = Field(default=False, description="Keep generating past EOS (zserve).")
    user: str | None = Field(default=None, description="The caller's id; changes nothing.")

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        # before field validation: an unsupported field is named even when others are bad
        return check_unsupported(data, cls.__name__)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Any:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`."""

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts (one for a single text or token list)."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _batch_is_not_streamed(self) -> Any:
        if self.stream and len(self.prompts()) > 1:
            raise ValueError(
                f"prompt: a batch of {len(self.prompts())} prompts is not streamed; send one "
                "prompt per request, or stream: false"
            )
        return self

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="Text or token ids to continue; a list of them is a batch (not streamed): "
        "prompt i's choices have indices i*n .. i*n+n-1, as OpenAI numbers them."
    )
    max_tokens: int | None = Field(
        default=16, ge=0, description="OpenAI's default is 16; 0 only with echo (scoring)."
    )
    echo: bool = Field(default=False, description="Prepend the prompt to the text.")
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Log-probabilities of each token and of this many likeliest alternatives.",
    )

    @model_validator(mode="after")
    def _zero_tokens_only_to_echo(self) -> Any:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError(
                "max_tokens: must be >= 1 (got 0); 0 generates nothing and is only allowed "
                "with echo: true (scoring the prompt)"
            )
        return self


class ChatMessage(_Request):
    """One turn of a conversation; the tool fields reach the chat template as sent."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = Field(
        default=None, description="Required, except in an assistant turn that made tool calls."
    )
    name: str | None = Field(default=None, description="Passed to the chat template.")
    tool_calls: list[ToolCallIn] | None = Field(default=None, description="Assistant turns only.")
    tool_call_id: str | None = Field(
        default=None, description="Tool turns only: the call answered."
    )

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("role") != "assistant":
            raise ValueError(
                f"only an assistant message carries tool_calls (this is {info.data.get('role')!r})"
            )
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _ids_are_the_tools(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("role") != "tool":
            raise ValueError(
                f"only a tool message carries tool_call_id (this is {info.data.get('role')!r})"
            )
        return value

    @model_validator(mode="after")
    def _content_unless_calls(self) -> Any:
        if self.content is None and not self.tool_calls:
            raise ValueError(
                f"content: required in a {self.role} message (null only in an assistant "
                "message with tool_calls)"
            )
        return self


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`; `max_completion_tokens` is the newer name of `max_tokens`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = Field(default=False, description="Log-probability of each output token.")
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="Alternatives per token (logprobs)."
    )
    response_format: ResponseFormat | None = Field(
        default=None, description="json_object / json_schema: decoded to parse (and match)."
    )
    tools: list[Tool] | None = Field(
        default=None, description="Functions the model may call (its chat template must use them)."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="'auto' when tools are given, else 'none'."
    )
    parallel_tool_calls: bool | None = Field(
        default=None, description="zserve returns one call per choice, whatever this says."
    )

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> Any:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> Any:
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError(
                f"tool_choice: {_short(choice)} needs tools; send tools or leave it out"
            )
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if choice.function.name not in names:
                raise ValueError(
                    f"tool_choice: function {choice.function.name!r} is not among tools {names}"
                )
        if self.tools and self.response_format is not None and self.response_format.type != "text":
            raise ValueError(
                "response_format: json output and tools in one request are not supported; "
                "send one of them"
            )
        return self


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Legacy completions' logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A `text_completion`; streamed chunks use the same object with the new text only."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_only_when_made(self, handler: Any) -> dict[str, Any]:
        # OpenAI's message has `tool_calls` only when the model made calls
        body = handler(self)
        if body.get("tool_calls") is None:
            body.pop("tool_calls", None)
        return body


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "zstack"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorInfo


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """The JSON body of an error response."""
    return ErrorResponse(
        error=ErrorInfo(message=message, type=type_, param=param, code=code)
    ).model_dump()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def describe_validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One message naming every bad field (with the value sent) and the first field's name.

    ``errors`` is pydantic's ``ValidationError.errors()`` (or FastAPI's, whose
    locations start with ``"body"``).
    """
    parts: list[str] = []
    first: str | None = None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        # a union ("str | list[int]") reports once per member; the field is what matters
        loc = [p for p in loc if not _is_type_tag(p)]
        field = ".".join(loc) if loc else None
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            parts.append(
                f"malformed JSON body: {ctx.get('error', err.get('msg'))}; send a JSON object"
            )
            continue
        first = first or field
        value = err.get("input")
        msg = str(err.get("msg"))
        if err.get("type") == "extra_forbidden":
            msg = "unrecognized request argument (not an OpenAI field zserve knows)"
        elif err.get("type") == "value_error":
            msg = msg.removeprefix("Value error, ")
            if field is None:  # a whole-request check: the field is its message's first word
                first = first or msg.split()[0].rstrip(":")
                parts.append(msg)
                continue
        shown = "" if err.get("type") in ("missing", "value_error") else f" (got {_short(value)})"
        parts.append(f"{field or 'body'}: {msg}{shown}")
    # unions repeat one field per member; keep each message once, in order
    return "; ".join(dict.fromkeys(parts)), first


def validation_error_details(exc: ValidationError) -> tuple[str, str | None]:
    return describe_validation_error(list(exc.errors()))


def _is_type_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list[int]", "list[str]"} or part.startswith(
        ("list[", "function-")
    )


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""Request/response models of the OpenAI API subset zserve serves.

Requests are validated strictly (``"5"`` is not an integer, ``"yes"`` is not a
boolean) so a wrong type is a 400 naming the field rather than a silent
coercion. Unknown keys are ignored, as clients routinely send parameters
(``user``, ``logprobs: null``...) that change nothing here.

Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from zserve.config import SEED_MAX, SEED_MIN


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _SamplingFields(_Request):
    """Sampling parameters shared by completions and chat completions."""

    model: str = Field(description="Model id as listed by `/v1/models`.")
    max_tokens: int | None = Field(
        default=None, ge=1, description="Tokens to generate at most (>= 1)."
    )
    temperature: float = Field(default=1.0, ge=0.0, description="0 (or below 1e-5) means greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus mass in (0, 1].")
    top_k: int | None = Field(default=None, description="Keep the k likeliest tokens (zserve).")
    n: int = Field(default=1, ge=1, le=1, description="Choices per request; only 1 is served.")
    stream: bool = Field(default=False, description="Send Server-Sent Events as tokens arrive.")
    stop: str | list[str] | None = Field(default=None, description="Stop strings (up to 4).")
    seed: int | None = Field(
        default=None,
        ge=SEED_MIN,
        le=SEED_MAX,
        description="Seed (64-bit) of this request's sampler.",
    )
    ignore_eos: bool = Field(default=False, description="Keep generating past EOS (zserve).")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`."""

    prompt: str | list[int] = Field(description="Text, or token ids, to continue.")
    max_tokens: int | None = Field(default=16, ge=1, description="OpenAI's default is 16.")
    echo: bool = Field(default=False, description="Not supported; must be false.")


class ChatMessage(_Request):
    """One turn of a conversation."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`; `max_completion_tokens` is the newer name of `max_tokens`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
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
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
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
        shown = "" if err.get("type") == "missing" else f" (got {_short(value)})"
        parts.append(f"{field or 'body'}: {err.get('msg')}{shown}")
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

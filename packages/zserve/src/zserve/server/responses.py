"""Engine outputs -> OpenAI response bodies and SSE chunks, for ``n`` choices.

`CompletionShaper` / `ChatShaper` turn one choice's `RequestOutput` into that choice's
delta (text, logprobs, finish reason; with ``echo`` the prompt comes first). A whole
response merges the deltas per choice (`collect`); a stream sends them as they come
(`stream_chunks`), then, with ``stream_options.include_usage``, one chunk with
``usage`` and no choices, as OpenAI does, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from zserve.server.async_engine import EngineStepError
from zserve.server.choices import Choices
from zserve.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from zserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    Usage,
    error_body,
)

# how often a non-streaming request checks whether its client is still there
DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The client of a non-streaming request disconnected."""


def sse_event(payload: Any) -> str:
    """One Server-Sent Event carrying ``payload`` (a pydantic model, dict or the string [DONE])."""
    if isinstance(payload, str):
        data = payload
    elif hasattr(payload, "model_dump_json"):
        data = payload.model_dump_json(exclude_none=False)
    else:
        data = json.dumps(payload)
    return f"data: {data}\n\n"


def usage_of(choices: Choices) -> Usage:
    done = sum(choices.n_out)
    return Usage(
        prompt_tokens=choices.prompt_tokens,
        completion_tokens=done,
        total_tokens=choices.prompt_tokens + done,
    )


class CompletionShaper:
    """Deltas of `/v1/completions` choices."""

    def __init__(
        self,
        texts: TokenTexts,
        prompt_ids: list[int],
        echo_text: str | None,
        logprobs: bool,
    ) -> None:
        self.texts, self.prompt_ids, self.echo_text, self.logprobs = (
            texts,
            prompt_ids,
            echo_text,
            logprobs,
        )
        self.offsets: dict[int, int] = {}
        self.prompt_lp: list | None = None  # choice 0's; the other choices reuse it

    def delta(self, index: int, out: Any) -> CompletionChoice:
        if out.prompt_logprobs is not None and self.prompt_lp is None:
            self.prompt_lp = out.prompt_logprobs
        text, ids, entries = out.text, list(out.token_ids), list(out.logprobs or [])
        if index not in self.offsets:
            self.offsets[index] = 0
            if self.echo_text is not None:
                text = self.echo_text + text
                if self.logprobs:
                    prompt_lp = out.prompt_logprobs or self.prompt_lp
                    assert prompt_lp is not None, "echo with logprobs: no prompt logprobs"
                    ids, entries = self.prompt_ids + ids, list(prompt_lp) + entries
        lp = None
        if self.logprobs:
            lp, self.offsets[index] = completion_logprobs(
                self.texts, ids, entries, self.offsets[index]
            )
        reason = out.finish_reason if out.finished else None
        return CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=reason)

    @staticmethod
    def merge(a: CompletionChoice, b: CompletionChoice) -> CompletionChoice:
        if a.logprobs is not None and b.logprobs is not None:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(a.logprobs, key).extend(getattr(b.logprobs, key))
        a.text += b.text
        a.finish_reason = b.finish_reason
        return a

    def chunk(self, rid: str, model: str, choice: CompletionChoice) -> Any:
        return CompletionResponse(id=rid, model=model, choices=[choice])

    def first_chunks(self, rid: str, model: str, n: int) -> list[Any]:
        return []

    def usage_chunk(self, rid: str, model: str, usage: Usage) -> Any:
        return CompletionResponse(id=rid, model=model, choices=[], usage=usage)


class ChatShaper:
    """Deltas of `/v1/chat/completions` choices."""

    def __init__(self, texts: TokenTexts, logprobs: bool) -> None:
        self.texts, self.logprobs = texts, logprobs

    def delta(self, index: int, out: Any) -> ChatChunkChoice:
        lp = None
        if self.logprobs:
            lp = ChatLogprobs(content=chat_logprobs(self.texts, out.logprobs or []))
        return ChatChunkChoice(
            index=index,
            delta=ChatDelta(content=out.text or None),
            logprobs=lp,
            finish_reason=out.finish_reason if out.finished else None,
        )

    @staticmethod
    def merge(a: ChatChunkChoice, b: ChatChunkChoice) -> ChatChunkChoice:
        a.delta.content = (a.delta.content or "") + (b.delta.content or "")
        if a.logprobs is not None and b.logprobs is not None:
            (a.logprobs.content or []).extend(b.logprobs.content or [])
        a.finish_reason = b.finish_reason
        return a

    @staticmethod
    def to_choice(c: ChatChunkChoice) -> ChatChoice:
        return ChatChoice(
            index=c.index,
            message=ChatMessageOut(content=c.delta.content or ""),
            logprobs=c.logprobs,
            finish_reason=c.finish_reason,
        )

    def chunk(self, rid: str, model: str, choice: ChatChunkChoice) -> dict[str, Any]:
        # OpenAI's deltas carry only the keys that change ("role" once, then "content")
        body = ChatCompletionChunk(id=rid, model=model, choices=[choice]).model_dump()
        delta = body["choices"][0]["delta"]
        body["choices"][0]["delta"] = {k: v for k, v in delta.items() if v is not None}
        return body

    def first_chunks(self, rid: str, model: str, n: int) -> list[Any]:
        role = [
            ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
            for i in range(n)
        ]
        return [self.chunk(rid, model, c) for c in role]

    def usage_chunk(self, rid: str, model: str, usage: Usage) -> Any:
        return ChatCompletionChunk(id=rid, model=model, choices=[], usage=usage)


async def collect(choices: Choices, shaper: Any, request: Request, n: int) -> list[Any]:
    """Every choice's merged delta, in index order; raises `ClientGone` if the client
    disconnects meanwhile (the caller's `Choices.close` then aborts the requests)."""
    merged: dict[int, Any] = {}
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_S
    while not choices.done:
        got = await choices.get(timeout=DISCONNECT_POLL_S)
        # Checked on a clock, not only when the engine is quiet: a request whose tokens keep
        # coming faster than the poll interval must still notice its client has left.
        if got is None or loop.time() >= next_check:
            next_check = loop.time() + DISCONNECT_POLL_S
            if await request.is_disconnected():
                raise ClientGone
        if got is None:
            continue
        index, out = got
        d = shaper.delta(index, out)
        merged[index] = shaper.merge(merged[index], d) if index in merged else d
    return [merged[i] for i in range(n)]


async def stream_chunks(
    choices: Choices,
    shaper: Any,
    rid: str,
    model: str,
    n: int,
    include_usage: bool,
    on_close: Callable[[], None],
) -> AsyncIterator[str]:
    """The SSE body of a streamed response; ``on_close`` runs however it ends."""
    try:
        for chunk in shaper.first_chunks(rid, model, n):
            yield sse_event(chunk)
        while not choices.done:
            got = await choices.get()
            if got is None:
                continue
            index, out = got
            if not out.text and not out.finished and not out.logprobs:
                continue
            yield sse_event(shaper.chunk(rid, model, shaper.delta(index, out)))
        if include_usage:
            yield sse_event(shaper.usage_chunk(rid, model, usage_of(choices)))
        yield sse_event("[DONE]")
    except EngineStepError as exc:
        yield sse_event(error_body(str(exc), "server_error", None, "engine_error"))
    finally:
        on_close()

"""The OpenAI-compatible HTTP server of one engine (FastAPI).

`create_app(engine)` serves `/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/health` and `/metrics`. Every error is an OpenAI error body
whose message names the field at fault; a full queue is 429, a dead engine
503. A client that goes away (mid-stream or while waiting for a whole
completion) has its request aborted, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from zserve.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestStream,
)
from zserve.server.metrics import ServerMetrics, StatusMiddleware
from zserve.server.prometheus import Registry
from zserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    describe_validation_error,
    error_body,
    new_id,
)

# how often a non-streaming request checks whether its client is still there
DISCONNECT_POLL_S = 0.25


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _error(status: int, message: str, param: str | None = None, code: str | None = None):
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def create_app(engine: Any, max_queue: int = 256, model_name: str | None = None) -> FastAPI:
    """The server app of ``engine`` (a `zserve.engine.Engine`), at most ``max_queue`` in flight.

    The engine thread starts and stops with the app's lifespan.
    """
    aengine = AsyncEngine(engine, max_queue=max_queue)
    served_name = model_name or engine.model_name
    metrics = ServerMetrics(Registry(), aengine)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await aengine.start()
        try:
            yield
        finally:
            aengine.stop()

    app = FastAPI(title="zserve", lifespan=lifespan)
    app.state.async_engine = aengine
    app.state.metrics = metrics
    app.add_middleware(StatusMiddleware, counter=metrics.responses)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(list(exc.errors()))
        return _error(400, message, param)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(QueueFullError)
    async def _queue_full(_: Request, exc: QueueFullError) -> JSONResponse:
        return _error(429, str(exc), None, "queue_full")

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(503, str(exc), None, "engine_dead")

    def check_model(model: str) -> None:
        if model != served_name:
            raise APIError(
                404,
                f"model: {model!r} is not served here; this server serves {served_name!r} "
                "(see `/v1/models`)",
                "model",
                "model_not_found",
            )

    def check_length(n_prompt: int, max_tokens: int | None, prompt_field: str) -> int:
        # the engine's max_model_len is already capped at what its KV cache holds, so a
        # defaulted max_tokens fits and a request that never could is a 400 here
        limit = aengine.max_model_len
        if n_prompt >= limit:
            raise APIError(
                400,
                f"{prompt_field}: {n_prompt} tokens, but the context of {served_name} is "
                f"{limit} tokens (prompt + output); shorten the {prompt_field}",
                prompt_field,
                "context_length_exceeded",
            )
        if max_tokens is None:
            return limit - n_prompt
        if n_prompt + max_tokens > limit:
            raise APIError(
                400,
                f"max_tokens: {max_tokens} + {n_prompt} prompt tokens = {n_prompt + max_tokens} "
                f"exceeds the context of {limit} tokens (max_model_len in /v1/models: the "
                f"model's, or what the KV cache holds); ask for at most {limit - n_prompt}",
                "max_tokens",
                "context_length_exceeded",
            )
        return max_tokens

    async def start(
        req: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        max_tokens: int,
    ) -> RequestStream:
        params = _sampling_params(req, max_tokens)
        try:
            return await aengine.submit(prompt_ids, params, prompt_tokens=len(prompt_ids))
        except ValueError as exc:  # the engine rejected the request
            raise APIError(400, str(exc), _param_of(str(exc))) from exc

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        if req.echo:
            raise APIError(400, "echo: true is not supported; send echo: false", "echo")
        if isinstance(req.prompt, str):
            prompt_ids = list(aengine.tokenizer.encode(req.prompt))
        else:
            prompt_ids = list(req.prompt)
        if not prompt_ids:
            raise APIError(400, "prompt: empty; send at least one token of text", "prompt")
        max_tokens = check_length(len(prompt_ids), req.max_tokens, "prompt")
        stream = await start(req, prompt_ids, max_tokens)
        rid = new_id("cmpl")
        if req.stream:
            return _sse(_completion_chunks(stream, rid, served_name, aengine, metrics))
        text, reason, n_out = await _collect(stream, request, aengine, metrics)
        return CompletionResponse(
            id=rid,
            model=served_name,
            choices=[CompletionChoice(text=text, finish_reason=reason)],
            usage=Usage(
                prompt_tokens=stream.prompt_tokens,
                completion_tokens=n_out,
                total_tokens=stream.prompt_tokens + n_out,
            ),
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        messages = [m.model_dump() for m in req.messages]
        try:
            # the template writes the BOS it wants: encoded without special tokens
            prompt_ids = list(aengine.tokenizer.chat_token_ids(messages))
        except ValueError as exc:  # no chat template, or one that refuses these messages
            raise APIError(400, f"messages: {exc}", "messages") from exc
        wanted = req.max_completion_tokens or req.max_tokens
        max_tokens = check_length(len(prompt_ids), wanted, "messages")
        stream = await start(req, prompt_ids, max_tokens)
        rid = new_id("chatcmpl")
        if req.stream:
            return _sse(_chat_chunks(stream, rid, served_name, aengine, metrics))
        text, reason, n_out = await _collect(stream, request, aengine, metrics)
        return ChatCompletionResponse(
            id=rid,
            model=served_name,
            choices=[ChatChoice(message=ChatMessageOut(content=text), finish_reason=reason)],
            usage=Usage(
                prompt_tokens=stream.prompt_tokens,
                completion_tokens=n_out,
                total_tokens=stream.prompt_tokens + n_out,
            ),
        )

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_name, max_model_len=aengine.max_model_len)])

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": "ok" if aengine.alive else "dead", "model": served_name}
        body.update(aengine.stats())
        return JSONResponse(body, status_code=200 if aengine.alive else 503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def _sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> Any:
    from zserve.sampling import SamplingParams

    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop": req.stop_strings(),
        "ignore_eos": req.ignore_eos,
    }
    if req.top_k is not None:
        kwargs["top_k"] = req.top_k
    if req.seed is not None:
        kwargs["seed"] = req.seed
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), _param_of(str(exc))) from exc


_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "prompt")


def _param_of(message: str) -> str | None:
    """The request field an engine/sampling error message names, if any."""
    hits = [(message.find(f), f) for f in _FIELDS if f in message]
    return min(hits)[1] if hits else None


def _sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        chunks,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def sse_event(payload: Any) -> str:
    """One Server-Sent Event carrying ``payload`` (a pydantic model, dict or the string [DONE])."""
    if isinstance(payload, str):
        data = payload
    elif hasattr(payload, "model_dump_json"):
        data = payload.model_dump_json(exclude_none=False)
    else:
        data = json.dumps(payload)
    return f"data: {data}\n\n"


def _raise_if_error(out: Any) -> None:
    if out.finished and out.finish_reason == "error":
        raise EngineStepError(f"request failed in the engine: {out.error}")


async def _collect(
    stream: RequestStream, request: Request, aengine: AsyncEngine, metrics: ServerMetrics
) -> tuple[str, str | None, int]:
    """Wait for the whole completion, aborting it if the client disconnects meanwhile."""
    parts: list[str] = []
    reason: str | None = None
    n_out = 0
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            out = await stream.get(timeout=DISCONNECT_POLL_S)
            # Checked on a clock, not only when the engine is quiet: a request whose tokens keep
            # coming faster than the poll interval must still notice its client has left.
            if out is None or loop.time() >= next_check:
                next_check = loop.time() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise APIError(499, "client disconnected")
            if out is None:
                continue
            _raise_if_error(out)
            parts.append(out.text)
            n_out += len(out.token_ids)
            if out.finished:
                reason = out.finish_reason
                break
    except EngineStepError as exc:
        raise APIError(500, str(exc), None, "engine_error") from exc
    finally:
        stream.close()
        if not stream.finished:
            aengine.abort(stream.request_id)
        metrics.finished(stream, n_out)
    return "".join(parts), reason, n_out


async def _completion_chunks(
    stream: RequestStream, rid: str, model: str, aengine: AsyncEngine, metrics: ServerMetrics
) -> AsyncIterator[str]:
    n_out = 0
    try:
        async for out in stream:
            _raise_if_error(out)
            n_out += len(out.token_ids)
            if not out.text and not out.finished:
                continue
            usage = None
            if out.finished:
                usage = Usage(
                    prompt_tokens=stream.prompt_tokens,
                    completion_tokens=n_out,
                    total_tokens=stream.prompt_tokens + n_out,
                )
            chunk = CompletionResponse(
                id=rid,
                model=model,
                choices=[
                    CompletionChoice(
                        text=out.text, finish_reason=out.finish_reason if out.finished else None
                    )
                ],
                usage=usage,
            )
            yield sse_event(chunk)
        yield sse_event("[DONE]")
    except EngineStepError as exc:
        yield sse_event(error_body(str(exc), "server_error", None, "engine_error"))
    finally:
        _stream_closed(stream, aengine, metrics, n_out)


async def _chat_chunks(
    stream: RequestStream, rid: str, model: str, aengine: AsyncEngine, metrics: ServerMetrics
) -> AsyncIterator[str]:
    n_out = 0
    try:
        first = ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))
        yield sse_event(_chat_chunk(rid, model, first))
        async for out in stream:
            _raise_if_error(out)
            n_out += len(out.token_ids)
            if not out.text and not out.finished:
                continue
            choice = ChatChunkChoice(
                delta=ChatDelta(content=out.text or None),
                finish_reason=out.finish_reason if out.finished else None,
            )
            yield sse_event(_chat_chunk(rid, model, choice))
        yield sse_event("[DONE]")
    except EngineStepError as exc:
        yield sse_event(error_body(str(exc), "server_error", None, "engine_error"))
    finally:
        _stream_closed(stream, aengine, metrics, n_out)


def _chat_chunk(rid: str, model: str, choice: ChatChunkChoice) -> dict[str, Any]:
    # OpenAI's deltas carry only the keys that change ("role" once, then "content")
    chunk = ChatCompletionChunk(id=rid, model=model, choices=[choice]).model_dump()
    delta = chunk["choices"][0]["delta"]
    chunk["choices"][0]["delta"] = {k: v for k, v in delta.items() if v is not None}
    return chunk


def _stream_closed(
    stream: RequestStream, aengine: AsyncEngine, metrics: ServerMetrics, n_out: int
) -> None:
    # runs on normal end, on client disconnect (the stream task is cancelled) and on error
    stream.close()
    if not stream.finished:
        aengine.abort(stream.request_id)
    metrics.finished(stream, n_out)

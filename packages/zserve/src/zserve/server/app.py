"""The OpenAI-compatible HTTP server of one engine (FastAPI).

`create_app(engine)` serves `/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/health` and `/metrics`. Every error is an OpenAI error body
whose message names the field at fault; a full queue is 429, a dead engine
503. A client that goes away (mid-stream or while waiting for a whole
completion) has its request aborted, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from zserve.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
)
from zserve.server.choices import Choices
from zserve.server.logprobs import TokenTexts
from zserve.server.metrics import ServerMetrics, StatusMiddleware
from zserve.server.prometheus import Registry
from zserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    describe_validation_error,
    error_body,
    new_id,
)
from zserve.server.responses import (
    ChatShaper,
    ClientGone,
    CompletionShaper,
    collect,
    sse_event,
    stream_chunks,
    usage_of,
)
from zserve.server.tools import forced_call_spec, parse_tool_calls, render_chat_with_tools

__all__ = ["APIError", "create_app", "sse_event"]


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

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # unknown path (404), wrong method (405)...: OpenAI's shape, not FastAPI's {"detail"}
        return _error(exc.status_code, f"{exc.detail}; see `/v1/models` and the OpenAI API paths")

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

    texts = TokenTexts(aengine.tokenizer)

    async def respond(
        req: CompletionRequest | ChatCompletionRequest,
        request: Request,
        prompt_ids: list[int],
        params: Any,
        shaper: Any,
        rid: str,
    ) -> Any:
        """Run the request's ``n`` choices; a stream, or the merged deltas and the usage."""
        choices = Choices(aengine, metrics)
        try:
            await choices.start(prompt_ids, params, req.n)
        except ValueError as exc:  # the engine rejected the request
            raise APIError(400, str(exc), _param_of(str(exc))) from exc
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return _sse(
                stream_chunks(
                    choices, shaper, rid, served_name, req.n, include_usage, choices.close
                )
            )
        try:
            merged = await collect(choices, shaper, request, req.n)
        except ClientGone as exc:
            raise APIError(499, "client disconnected") from exc
        except EngineStepError as exc:
            raise APIError(500, str(exc), None, "engine_error") from exc
        finally:
            choices.close()
        return merged, usage_of(choices)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        prompts = req.prompts()
        rid = new_id("cmpl")
        if req.stream:  # one prompt (the protocol refuses a streamed batch)
            return await complete_one(req, request, prompts[0], rid)
        # a batch: each prompt's n choices run at once; prompt i's are numbered i*n..
        got = await asyncio.gather(*(complete_one(req, request, p, rid) for p in prompts))
        choices: list[Any] = []
        counts = [0, 0]
        for i, (merged, usage) in enumerate(got):
            for c in merged:
                c.index += i * req.n
            choices += merged
            counts[0] += usage.prompt_tokens
            counts[1] += usage.completion_tokens
        usage = Usage(
            prompt_tokens=counts[0], completion_tokens=counts[1], total_tokens=sum(counts)
        )
        return CompletionResponse(id=rid, model=served_name, choices=choices, usage=usage)

    async def complete_one(
        req: CompletionRequest, request: Request, prompt: str | list[int], rid: str
    ) -> Any:
        """One prompt's stream, or its merged choices and usage."""
        if isinstance(prompt, str):
            prompt_ids = list(aengine.tokenizer.encode(prompt))
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise APIError(400, "prompt: empty; send at least one token of text", "prompt")
        max_tokens = check_length(len(prompt_ids), req.max_tokens, "prompt")
        echo_text = None
        if req.echo:
            echo_text = prompt if isinstance(prompt, str) else _decode(prompt_ids)
        # scoring the prompt (echo + logprobs); max_tokens 0 runs the prompt only, which the
        # engine does as a scoring request whose scores are then left out
        scored = req.logprobs if req.echo and req.logprobs is not None else None
        if max_tokens == 0 and scored is None:
            scored = 0
        params = _sampling_params(req, max_tokens, logprobs=req.logprobs, prompt_logprobs=scored)
        shaper = CompletionShaper(texts, prompt_ids, echo_text, req.logprobs is not None)
        return await respond(req, request, prompt_ids, params, shaper, rid)

    def check_structured(spec: Any, param: str) -> None:
        if spec is not None and not getattr(aengine.engine, "supports_structured", False):
            raise APIError(
                400,
                f"{param}: needs constrained decoding, which the {type(aengine.engine).__name__}"
                " does not do; serve with policy 'splitfuse' or 'prefill-first'",
                param,
            )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = req.tools or []
        tool_choice = req.tool_choice or ("auto" if tools else "none")
        try:
            # the template writes the BOS it wants: encoded without special tokens
            if tools:
                prompt_ids = render_chat_with_tools(aengine.tokenizer, messages, tools)
            else:
                prompt_ids = list(aengine.tokenizer.chat_token_ids(messages))
        except ValueError as exc:  # no chat template, or one that refuses these messages
            message = (
                str(exc) if str(exc).startswith(("tools:", "messages:")) else f"messages: {exc}"
            )
            raise APIError(400, message, message.split(":")[0]) from exc
        if tools and req.stream:  # checked after the template: a model without tools says so
            raise APIError(
                400,
                "stream: streaming with tools is not implemented; send stream: false",
                "stream",
            )
        wanted = req.max_completion_tokens or req.max_tokens
        max_tokens = check_length(len(prompt_ids), wanted, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        try:
            spec = _response_format_spec(req)
            param = "response_format"
            if spec is None and tools:
                spec, param = forced_call_spec(tools, tool_choice), "tool_choice"
        except ValueError as exc:
            raise APIError(400, str(exc), str(exc).split(":")[0]) from exc
        check_structured(spec, param)
        params = _sampling_params(req, max_tokens, logprobs=logprobs, structured=spec)
        shaper = ChatShaper(texts, req.logprobs)
        rid = new_id("chatcmpl")
        got = await respond(req, request, prompt_ids, params, shaper, rid)
        if not isinstance(got, tuple):
            return got
        merged, usage = got
        choices = [ChatShaper.to_choice(c) for c in merged]
        if tools and tool_choice != "none":
            for c in choices:
                calls = parse_tool_calls(c.message.content or "", tools)
                if calls is not None and c.finish_reason == "stop":
                    c.message = ChatMessageOut(content=None, tool_calls=calls)
                    c.finish_reason = "tool_calls"
        return ChatCompletionResponse(id=rid, model=served_name, choices=choices, usage=usage)

    def _decode(ids: list[int]) -> str:
        return aengine.tokenizer.decode(ids, skip_special_tokens=False)

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


def _sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    structured: Any = None,
) -> Any:
    from zserve.sampling import SamplingParams

    kwargs: dict[str, Any] = {
        "structured": structured,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
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


def _response_format_spec(req: ChatCompletionRequest) -> Any:
    """The grammar `response_format` asks for (None for text); ValueError naming it."""
    from zserve.structured import json_object, json_schema

    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_object()
    assert fmt.json_schema is not None  # the protocol checks it
    try:
        return json_schema(fmt.json_schema.schema_ or {})
    except ValueError as exc:
        raise ValueError(f"response_format: json_schema.schema: {exc}") from exc


_FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "stop",
    "prompt",
    "logprobs",
)


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

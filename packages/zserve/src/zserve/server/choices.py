"""The ``n`` engine requests behind one API request, read as one stream.

Choice 0 is submitted first; choices 1.. follow once its first output arrives, when its
prompt's full KV blocks are in the prefix cache, so they reuse them rather than compute
the prompt again (every block but the last, partial one; with prefix caching off, or a
request scoring its prompt, each computes its own). With a seed, choice i samples with
``seed + i`` (wrapped into 64 bits, vLLM does the same), so seeded choices differ and are
reproducible; greedy choices are identical.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from zserve.config import SEED_MAX, SEED_MIN
from zserve.server.async_engine import AsyncEngine, EngineStepError, RequestStream
from zserve.server.metrics import ServerMetrics


def child_params(params: Any, index: int) -> Any:
    """The sampling parameters of choice ``index`` (> 0): its own seed; the prompt's
    logprobs are choice 0's, so only a scoring-only request (max_tokens 0) asks again."""
    changes: dict[str, Any] = {}
    if params.seed is not None:
        span = SEED_MAX - SEED_MIN + 1
        changes["seed"] = (params.seed + index - SEED_MIN) % span + SEED_MIN
    if params.prompt_logprobs is not None and params.max_tokens > 0:
        changes["prompt_logprobs"] = None
    return dataclasses.replace(params, **changes)


class Choices:
    """``get()`` yields ``(choice index, output)`` of every choice, in arrival order."""

    def __init__(self, aengine: AsyncEngine, metrics: ServerMetrics) -> None:
        self.aengine = aengine
        self.metrics = metrics
        self.streams: list[RequestStream] = []
        self.n_out: list[int] = []
        self.finished: list[bool] = []
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    @property
    def prompt_tokens(self) -> int:
        return self.streams[0].prompt_tokens

    @property
    def done(self) -> bool:
        return all(self.finished)

    async def start(self, prompt_ids: list[int], params: Any, n: int) -> None:
        """Submit the ``n`` requests (see the module's docstring); on failure none stays."""
        try:
            self._add(await self.aengine.submit(prompt_ids, params, len(prompt_ids)))
            if n > 1:
                await self.streams[0].started.wait()
            for i in range(1, n):
                sub = child_params(params, i)
                self._add(await self.aengine.submit(prompt_ids, sub, len(prompt_ids)))
        except BaseException:
            self.close()
            raise

    def _add(self, stream: RequestStream) -> None:
        index = len(self.streams)
        self.streams.append(stream)
        self.n_out.append(0)
        self.finished.append(False)
        self._tasks.append(asyncio.ensure_future(self._pump(index, stream)))

    async def _pump(self, index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((index, out))
        except Exception as exc:  # the request failed: its reader raises it
            self._queue.put_nowait((index, exc))

    async def get(self, timeout: float | None = None) -> tuple[int, Any] | None:
        """The next output of any choice, or None after ``timeout`` seconds without one.
        Raises what a request failed with (`EngineStepError` for an engine error)."""
        try:
            index, out = await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if isinstance(out, BaseException):
            self.finished[index] = True
            raise out
        if out.finished and out.finish_reason == "error":
            self.finished[index] = True
            raise EngineStepError(f"request failed in the engine: {out.error}")
        self.n_out[index] += len(out.token_ids)
        self.finished[index] = out.finished
        return index, out

    def close(self) -> None:
        """Stop reading; abort what has not finished (frees its KV blocks), count each."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for stream, n_out in zip(self.streams, self.n_out, strict=True):
            stream.close()
            if not stream.finished:
                self.aengine.abort(stream.request_id)
            self.metrics.finished(stream, n_out)

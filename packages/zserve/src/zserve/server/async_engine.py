"""`AsyncEngine`: the asyncio face of the (single-threaded) `Engine`.

One background thread owns the engine and is the only caller of its methods
(the engine is not thread-safe). The event loop talks to it through a FIFO
inbox of commands (add / abort); outputs of each engine step go back to the
loop in one ``loop.call_soon_threadsafe`` call, which fans them out to one
``asyncio.Queue`` per request. Admission is bounded: at most ``max_queue``
requests are in the server (waiting or running) at once, the next one gets
`QueueFullError` (HTTP 429) instead of an ever longer wait.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The server holds `max_queue` requests already; the client should retry later (429)."""


class EngineDeadError(RuntimeError):
    """The engine thread is not running (stopped, or crashed); the server cannot serve (503)."""


class EngineStepError(RuntimeError):
    """An engine step raised; every request in flight at that moment fails with this."""


@dataclass
class RequestStream:
    """Outputs of one request as they arrive; iterate with ``async for``."""

    request_id: str
    prompt_tokens: int
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished: bool = False
    #: ended with an error (the engine's or its own) rather than an output
    failed: bool = False
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    #: set when the first output (or the error) arrives: the prompt has run
    started: asyncio.Event = field(default_factory=asyncio.Event)

    _pending: asyncio.Task | None = None

    async def get(self, timeout: float | None = None) -> Any:
        """The next output, or None after ``timeout`` seconds without one.

        Raises the error the request failed with. A timed-out wait keeps its
        queue read pending (never cancels it), so no output is ever lost.
        """
        if self._pending is None:
            self._pending = asyncio.ensure_future(self.queue.get())
        done, _ = await asyncio.wait({self._pending}, timeout=timeout)
        if not done:
            return None
        item = self._pending.result()
        self._pending = None
        if isinstance(item, BaseException):
            self.finished = self.failed = True
            raise item
        if item.token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if item.finished:
            self.finished = True
            self.failed = getattr(item, "finish_reason", None) == "error"
        return item

    async def __aiter__(self) -> AsyncIterator[Any]:
        while not self.finished:
            yield await self.get()

    def close(self) -> None:
        """Drop a pending read (the consumer is gone)."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None


class AsyncEngine:
    """Run ``engine`` on a background thread; submit requests from the event loop.

    Call `start` from the event loop that will submit requests and `stop` when
    done. ``max_queue`` bounds the requests in the server at once.
    """

    def __init__(self, engine: Any, max_queue: int = 256) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stats: dict[str, Any] = dict(engine.stats())
        self.step_errors = 0
        self.fatal_error: BaseException | None = None
        """The error that stopped the engine thread for good, if one did."""

    # -- what the HTTP layer reads ------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def queue_depth(self) -> int:
        """Requests submitted and not yet finished (waiting or running)."""
        return len(self._streams)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal_error is None

    def stats(self) -> dict[str, Any]:
        """The engine's stats after its latest step, plus the server's queue depth."""
        return {**self._stats, "queue_depth": self.queue_depth, "max_queue": self.max_queue}

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="zserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still in flight fail with `EngineDeadError`.

        Call from the event loop thread (the app's lifespan does)."""
        self._stopping.set()
        self._inbox.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail(list(self._streams), EngineDeadError("the server is shutting down"))

    # -- requests -------------------------------------------------------------------------
    async def submit(
        self,
        prompt: str | list[int],
        params: Any,
        prompt_tokens: int,
        request_id: str | None = None,
    ) -> RequestStream:
        """Hand a request to the engine; returns once the engine has accepted it.

        Raises `QueueFullError` when full, `EngineDeadError` when the engine
        thread is gone, and the engine's own `ValueError` for a request it
        rejects (too long a prompt, say).
        """
        if not self.alive:
            why = "" if self.fatal_error is None else f" ({self.fatal_error})"
            raise EngineDeadError(f"the engine thread is not running{why}; restart the server")
        if len(self._streams) >= self.max_queue:
            raise QueueFullError(
                f"server queue is full ({len(self._streams)} requests in flight, "
                f"max_queue={self.max_queue}); retry later or start the server with a larger "
                "`--max-queue`"
            )
        rid = request_id or uuid.uuid4().hex
        stream = RequestStream(request_id=rid, prompt_tokens=prompt_tokens)
        self._streams[rid] = stream
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self._inbox.put(("add", rid, prompt, params, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(rid)
            raise
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (the client went away); the engine frees its KV blocks at once."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self._inbox.put(("abort", request_id))

    # -- event-loop side of the hand-off ---------------------------------------------------
    def _resolve(self, fut: asyncio.Future, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    def _deliver(self, outputs: list[Any]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            stream.queue.put_nowait(out)
            stream.started.set()
            if out.finished:
                del self._streams[out.request_id]

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.queue.put_nowait(error)
                stream.started.set()

    def _post(self, fn, *args) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        active: set[str] = set()
        while not self._stopping.is_set():
            commands: list[tuple] = []
            try:
                # idle: block for the next command; busy: take what is there and step
                block = not engine.has_unfinished()
                commands.append(self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait())
                while True:
                    commands.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            for cmd in commands:
                self._handle(cmd, active)
            stepped = engine.has_unfinished()
            if stepped:
                try:
                    outputs = engine.step()
                except Exception as exc:  # keep serving: fail what was running, free it
                    log.exception("engine step failed")
                    self.step_errors += 1
                    failed = sorted(active)
                    for rid in failed:
                        self._abort_quietly(rid)
                    active.clear()
                    self._post(self._fail, failed, EngineStepError(f"engine step failed: {exc!r}"))
                    outputs = []
                    if getattr(exc, "fatal", False):  # it cannot step again (a tp rank died)
                        self._stop_fatal(exc)
                        return
                for out in outputs:
                    if out.finished:
                        active.discard(out.request_id)
                if outputs:
                    self._post(self._deliver, outputs)
            if commands or stepped:  # stats can only change when the engine did something
                self._stats = dict(engine.stats())

    def _stop_fatal(self, exc: BaseException) -> None:
        """End the engine thread after an error the engine cannot step past: every request
        still in the server, and every later one, fails naming it (`alive` turns False)."""
        self.fatal_error = exc  # from here `alive` is False: no submit queues another add
        self._post(self._drain, EngineDeadError(f"the engine stopped: {exc}"))

    def _drain(self, error: BaseException) -> None:
        """On the event loop, after a fatal error: fail what the inbox and streams hold."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self._resolve(cmd[4], error)
        self._fail(list(self._streams), error)

    def _handle(self, cmd: tuple, active: set[str]) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, fut = cmd
            try:
                self.engine.add_request(rid, prompt, params)
            except Exception as exc:
                self._post(self._resolve, fut, exc)
                return
            active.add(rid)
            self._post(self._resolve, fut, None)
        elif kind == "abort":
            rid = cmd[1]
            if rid in active:
                active.discard(rid)
                self._abort_quietly(rid)

    def _abort_quietly(self, rid: str) -> None:
        try:
            self.engine.abort(rid)
        except Exception:  # already finished inside the engine: nothing to free
            log.debug("abort of %s ignored", rid, exc_info=True)

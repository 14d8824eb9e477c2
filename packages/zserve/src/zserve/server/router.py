"""The front end of `--replicas N`: one FastAPI app that proxies to N engine servers.

Each request goes to the live replica with the fewest requests in flight
(ties rotate, so a trickle of requests still spreads). Bodies and SSE streams
are relayed byte for byte. A replica that refuses a connection is marked down
and the request is retried on another (it never reached the dead one); a
replica that dies while answering fails only the requests it held, with a 502
(or, mid-stream, an SSE error event) naming it. A background task polls every
replica's ``/health`` and its process, so a replica is out of rotation within
one interval of dying and back in once it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from zserve.server.prometheus import Registry
from zserve.server.protocol import error_body
from zserve.server.replicas import Replica

log = logging.getLogger(__name__)


class Router:
    """Least-loaded choice over replicas, with their health."""

    def __init__(self, replicas: Sequence[Replica]) -> None:
        if not replicas:
            raise ValueError("Router needs at least one replica, got 0")
        self.replicas = list(replicas)
        self._next = 0  # where the tie-break rotation starts

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def pick(self, exclude: frozenset[int] = frozenset()) -> Replica | None:
        """The live replica with the fewest in flight (not in ``exclude``), or None."""
        n = len(self.replicas)
        order = [self.replicas[(self._next + i) % n] for i in range(n)]
        candidates = [r for r in order if r.healthy and r.index not in exclude]
        if not candidates:
            return None
        best = min(candidates, key=lambda r: r.in_flight)  # first minimum in rotation order
        self._next = (best.index + 1) % n
        return best

    def mark_down(self, replica: Replica, why: str) -> None:
        if replica.healthy:
            log.warning("replica %d (%s) marked down: %s", replica.index, replica.url, why)
        replica.healthy = False
        replica.last_error = why

    async def check(self, client: httpx.AsyncClient, replica: Replica) -> None:
        """Refresh one replica's health from its process and its `/health`."""
        if not replica.process_alive():
            self.mark_down(replica, f"process {replica.pid} exited ({replica.returncode()})")
            return
        try:
            resp = await client.get(f"{replica.url}/health", timeout=5.0)
            ok = resp.status_code == 200
            why = f"/health answered {resp.status_code}"
        except httpx.HTTPError as exc:
            ok, why = False, f"/health failed: {exc!r}"
        if ok:
            replica.healthy = True
        else:
            self.mark_down(replica, why)


class ClientGone(Exception):
    """The front end's client disconnected; its upstream request was cancelled."""


async def _unless_disconnected(request: Request, work: Any, poll_s: float = 0.25) -> Any:
    """Await ``work``; if the client disconnects first, cancel it and raise `ClientGone`.

    Cancelling an httpx request closes its connection to the replica, which then aborts
    the generation and frees its KV blocks (the replica's own disconnect handling)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task


def _replica_label(r: Replica) -> tuple[tuple[str, str], ...]:
    return (("replica", str(r.index)),)


def create_router_app(replicas: Sequence[Replica], health_interval_s: float = 1.0) -> FastAPI:
    """The front-end app over ``replicas`` (already started and healthy)."""
    router = Router(replicas)
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0),
        limits=httpx.Limits(max_connections=4096, max_keepalive_connections=256),
    )
    registry = Registry()
    routed = registry.counter("zserve_router_requests_total", "Requests sent to each replica.")
    failed = registry.counter(
        "zserve_router_failures_total", "Requests a replica failed (connection lost)."
    )
    rejected = registry.counter(
        "zserve_router_unavailable_total", "Requests answered 503: no live replica."
    )
    registry.gauge(
        "zserve_router_in_flight",
        "Requests in flight per replica.",
        lambda: {_replica_label(r): float(r.in_flight) for r in router.replicas},
    )
    registry.gauge(
        "zserve_router_replica_up",
        "1 while a replica is in rotation.",
        lambda: {_replica_label(r): float(r.healthy) for r in router.replicas},
    )

    async def health_loop() -> None:
        while True:
            await asyncio.gather(*(router.check(client, r) for r in router.replicas))
            await asyncio.sleep(health_interval_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(health_loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await client.aclose()

    app = FastAPI(title="zserve router", lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    def unavailable(tried: frozenset[int]) -> JSONResponse:
        rejected.inc()
        down = "; ".join(f"replica {r.index}: {r.last_error}" for r in router.replicas)
        return JSONResponse(
            error_body(
                f"no live replica ({len(router.live())} of {len(router.replicas)} up; "
                f"tried {sorted(tried)}): {down}; retry later or restart `z serve`",
                "server_error",
                None,
                "no_replica",
            ),
            status_code=503,
        )

    def replica_failed(rep: Replica, exc: BaseException) -> dict[str, Any]:
        why = f"replica {rep.index} (pid {rep.pid}, {rep.url}) failed mid-request: {exc!r}"
        router.mark_down(rep, why)
        failed.inc(replica=str(rep.index))
        return error_body(why, "server_error", None, "replica_failed")

    async def relay(resp: httpx.Response, rep: Replica) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            body = replica_failed(rep, exc)
            yield f"data: {json.dumps(body)}\n\n".encode()
        finally:
            rep.in_flight -= 1
            await resp.aclose()

    async def proxy(request: Request, path: str) -> Response:
        body = await request.body()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        tried: frozenset[int] = frozenset()
        while True:
            rep = router.pick(exclude=tried)
            if rep is None:
                return unavailable(tried)
            rep.in_flight += 1
            rep.routed += 1
            routed.inc(replica=str(rep.index))
            upstream = client.build_request(
                request.method, rep.url + path, content=body, headers=headers
            )
            try:
                resp = await _unless_disconnected(request, client.send(upstream, stream=True))
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # never reached the replica: safe to send elsewhere
                rep.in_flight -= 1
                router.mark_down(rep, f"connect failed: {exc!r}")
                tried = tried | {rep.index}
            except httpx.HTTPError as exc:
                rep.in_flight -= 1
                return JSONResponse(replica_failed(rep, exc), status_code=502)
            except BaseException:  # the client left (or cancelled): nothing to relay
                rep.in_flight -= 1
                raise
        media = resp.headers.get("content-type", "application/json")
        if media.startswith("text/event-stream"):
            return StreamingResponse(
                relay(resp, rep),
                status_code=resp.status_code,
                media_type=media,
                headers={"x-zserve-replica": str(rep.index)},
            )
        try:
            data = await _unless_disconnected(request, resp.aread())
        except httpx.HTTPError as exc:
            return JSONResponse(replica_failed(rep, exc), status_code=502)
        finally:
            rep.in_flight -= 1
            await resp.aclose()
        return Response(
            data,
            status_code=resp.status_code,
            media_type=media,
            headers={"x-zserve-replica": str(rep.index)},
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy(request, "/v1/models")

    @app.get("/health")
    async def health() -> JSONResponse:
        live = router.live()
        body = {
            "status": "ok" if live else "unavailable",
            "live_replicas": len(live),
            "replicas": [r.describe() for r in router.replicas],
        }
        return JSONResponse(body, status_code=200 if live else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(registry.render(), media_type="text/plain; version=0.0.4")

    return app

"""What one server measures: `ServerMetrics` (Prometheus series over the
`AsyncEngine`) and `StatusMiddleware`, which counts responses by path and
status without wrapping the body (so streaming and disconnect detection are
untouched, unlike Starlette's ``BaseHTTPMiddleware``).
"""

from __future__ import annotations

import time
from typing import Any

from zserve.server.prometheus import Counter, Registry


class ServerMetrics:
    """Request, token, queue, KV-cache and latency series of one engine server."""

    def __init__(self, registry: Registry, aengine: Any) -> None:
        self.registry = registry
        self.aengine = aengine
        r = registry
        self.responses = r.counter(
            "zserve_http_responses_total", "HTTP responses by path and status code."
        )
        self.requests = r.counter(
            "zserve_requests_total", "Generation requests that ended, by how they ended."
        )
        self.prompt_tokens = r.counter("zserve_prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = r.counter(
            "zserve_generation_tokens_total", "Tokens generated (sent or not)."
        )
        self.latency = r.histogram(
            "zserve_request_latency_seconds", "Submission to last token, per request."
        )
        self.ttft = r.histogram(
            "zserve_time_to_first_token_seconds", "Submission to first token, per request."
        )

        def stat(key: str):
            return lambda: float(self.aengine.stats().get(key, 0) or 0)

        r.gauge(
            "zserve_queue_depth",
            "Requests in the server (waiting or running).",
            stat("queue_depth"),
        )
        r.gauge(
            "zserve_max_queue", "Admission bound; beyond it requests get 429.", stat("max_queue")
        )
        r.gauge("zserve_num_running", "Sequences the engine is running.", stat("num_running"))
        r.gauge("zserve_num_waiting", "Sequences waiting for the engine.", stat("num_waiting"))
        r.gauge("zserve_num_preempted", "Preemptions so far.", stat("num_preempted"))
        r.gauge("zserve_kv_free_blocks", "Free KV-cache blocks.", stat("free_blocks"))
        r.gauge("zserve_kv_total_blocks", "KV-cache blocks in all.", stat("total_blocks"))
        r.gauge(
            "zserve_prefix_hits", "Prompt blocks served from the prefix cache.", stat("prefix_hits")
        )
        # Speculative decoding (0 when it is off).
        r.gauge(
            "zserve_spec_proposed_tokens",
            "Draft tokens verified by the target.",
            stat("spec_proposed_tokens"),
        )
        r.gauge(
            "zserve_spec_accepted_tokens",
            "Draft tokens the target accepted.",
            stat("spec_accepted_tokens"),
        )
        r.gauge(
            "zserve_spec_acceptance_rate",
            "Accepted / proposed draft tokens.",
            stat("spec_acceptance_rate"),
        )
        r.gauge(
            "zserve_engine_alive", "1 while the engine thread runs.", lambda: float(aengine.alive)
        )

    def finished(self, stream: Any, completion_tokens: int) -> None:
        """Record one request that ended (completed, aborted or failed)."""
        now = time.perf_counter()
        how = "failed" if stream.failed else "completed" if stream.finished else "aborted"
        self.requests.inc(outcome=how)
        self.prompt_tokens.inc(stream.prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if stream.finished and not stream.failed:
            self.latency.observe(now - stream.submitted_at)
        if stream.first_token_at is not None:
            self.ttft.observe(stream.first_token_at - stream.submitted_at)

    def render(self) -> str:
        return self.registry.render()


class StatusMiddleware:
    """Pure ASGI middleware: count each HTTP response by path and status code."""

    def __init__(self, app: Any, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                # The route's template, set on this scope by the router; a path no route
                # matched is "unmatched", so scanners cannot add a series per URL.
                path = getattr(scope.get("route"), "path", None) or "unmatched"
                self.counter.inc(path=path, code=str(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)

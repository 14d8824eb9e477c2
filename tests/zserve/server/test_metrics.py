"""Metric labels stay bounded and honest: responses are counted by route template (any
unrouted URL is "unmatched"), and a request that ends in an error counts as failed."""

from __future__ import annotations

import asyncio

import httpx

from tests.zserve.server.conftest import LiveServer
from zserve.server.async_engine import RequestStream
from zserve.server.metrics import ServerMetrics
from zserve.server.prometheus import Registry, parse_prometheus


def test_unrouted_urls_share_one_series(live_server: LiveServer) -> None:
    for i in range(5):
        r = httpx.get(f"{live_server.url}/scan/{i}/wp-login.php")
        assert r.status_code == 404
    assert httpx.get(f"{live_server.url}/v1/models").status_code == 200
    metrics = parse_prometheus(httpx.get(f"{live_server.url}/metrics").text)
    assert not [k for k in metrics if "/scan/" in k]
    assert metrics['zserve_http_responses_total{code="404",path="unmatched"}'] >= 5
    assert metrics['zserve_http_responses_total{code="200",path="/v1/models"}'] >= 1


def test_a_request_that_errs_counts_as_failed_not_completed() -> None:
    metrics = ServerMetrics(Registry(), aengine=None)

    async def ended_by(item: object) -> RequestStream:
        stream = RequestStream("r", prompt_tokens=3)
        stream.queue.put_nowait(item)
        try:
            await stream.get()
        except RuntimeError:
            pass
        return stream

    failed = asyncio.run(ended_by(RuntimeError("engine step failed")))
    assert failed.finished and failed.failed
    metrics.finished(failed, 0)
    aborted = RequestStream("r2", prompt_tokens=3)
    metrics.finished(aborted, 0)
    assert metrics.requests.get(outcome="failed") == 1
    assert metrics.requests.get(outcome="aborted") == 1
    assert metrics.requests.get(outcome="completed") == 0

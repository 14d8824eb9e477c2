"""Prometheus text exposition: counters, gauges and histograms render to text that parses back."""

from __future__ import annotations

from zserve.server.prometheus import Registry, parse_prometheus


def test_render_parses_back() -> None:
    reg = Registry()
    c = reg.counter("req_total", "Requests.")
    c.inc(path="/v1/completions", code="200")
    c.inc(2, path="/v1/completions", code="200")
    c.inc(path="/v1/completions", code="429")
    reg.gauge("free_blocks", "Free.", lambda: 7)
    reg.gauge("up", "Per replica.", lambda: {(("replica", "0"),): 1.0, (("replica", "1"),): 0.0})
    h = reg.histogram("lat_seconds", "Latency.")
    for v in (0.003, 0.2, 0.2, 100.0):
        h.observe(v)
    text = reg.render()
    assert "# TYPE req_total counter" in text and "# TYPE lat_seconds histogram" in text
    got = parse_prometheus(text)
    assert got['req_total{code="200",path="/v1/completions"}'] == 3
    assert got['req_total{code="429",path="/v1/completions"}'] == 1
    assert got["free_blocks"] == 7
    assert got['up{replica="0"}'] == 1 and got['up{replica="1"}'] == 0
    # cumulative buckets: 1 at <= 0.01, 3 at <= 0.25, all 4 at +Inf only
    assert got['lat_seconds_bucket{le="0.01"}'] == 1
    assert got['lat_seconds_bucket{le="0.25"}'] == 3
    assert got['lat_seconds_bucket{le="60.0"}'] == 3
    assert got['lat_seconds_bucket{le="+Inf"}'] == 4
    assert got["lat_seconds_count"] == 4
    assert abs(got["lat_seconds_sum"] - 100.403) < 1e-9

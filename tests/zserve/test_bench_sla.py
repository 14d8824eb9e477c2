"""The SLA of `z bench serve`: a generation rate held at every token, checked as FastGen's
evaluation does (EMA of inter-token latencies, or cumulative deadlines), not on average."""

from __future__ import annotations

import random
from pathlib import Path

from zcore.bench import load

scoring = load("_serve_sla", Path(__file__).resolve().parents[2] / "benchmarks")


def _ema_direct(xs: list[float], span: int) -> list[float]:
    """pandas `Series(xs).ewm(span=span).mean()` written out: weights (1-a)^i, normalized."""
    a = 2.0 / (span + 1)
    out = []
    for t in range(len(xs)):
        w = [(1 - a) ** i for i in range(t + 1)]
        out.append(sum(wi * xs[t - i] for i, wi in enumerate(w)) / sum(w))
    return out


def test_ema_check_matches_the_bias_corrected_ema() -> None:
    rng = random.Random(0)
    for _ in range(300):
        xs = [rng.expovariate(1.0) for _ in range(rng.randint(0, 40))]
        limit = rng.uniform(0.5, 2.5)
        want = all(v < limit for v in _ema_direct(xs, 16))
        assert scoring.ema_within(xs, limit, 16) == want


def test_a_stall_fails_although_the_mean_rate_holds() -> None:
    steady = [0.5] * 40  # 2 tok/s against a 1 tok/s SLA
    stalled = [0.5] * 20 + [6.0] + [0.5] * 19  # mean 0.64 s/token, but a 6 s stall
    assert scoring.ema_within(steady, 1.0, 16) and scoring.cum_within(steady, 1.0)
    assert sum(stalled) / len(stalled) < 1.0
    assert not scoring.ema_within(stalled, 1.0, 16)  # the EMA jumps to 0.5 + 5.5 * 2/17
    assert scoring.cum_within(stalled, 1.0)  # tokens banked early cover this stall...
    assert not scoring.cum_within([6.0] + [0.5] * 39, 1.0)  # ...but not one at the start


def test_summarize_counts_requests_that_hold_the_rate() -> None:
    sla = {"ttft_s": 1.0, "decode_tokens_per_s": 1.0, "ema_span": 16}
    records = {
        "ok": {"arrival": 0.0, "max_tokens": 5, "times": [0.5, 1.0, 1.5, 2.0, 2.5]},
        "late": {"arrival": 0.0, "max_tokens": 3, "times": [1.5, 2.0, 2.5]},  # TTFT 1.5 s
        "stall": {"arrival": 1.0, "max_tokens": 3, "times": [1.2, 5.2, 5.7]},
        "short": {"arrival": 0.0, "max_tokens": 4, "times": [0.5, 1.0]},  # never completed
    }
    got = scoring.summarize({"records": records, "timed_out": False}, sla)
    assert got["met_sla"] == 1 and got["met_sla_cum"] == 1
    assert got["completed"] == 3 and got["requests"] == 4
    assert got["effective_rps"] == 1 / 5.7

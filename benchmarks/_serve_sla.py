"""How `z bench serve` scores a run: throughput, TTFT and inter-token latency percentiles, and
the requests that met the SLA, judged per token as FastGen's evaluation does (DeepSpeedExamples
`benchmarks/inference/mii`, `plot_effective_throughput.py`): TTFT within a bound, and a
generation rate held at every token (the EMA of the inter-token latencies below 1/rate), or,
stricter, token i within (i+1)/rate of the first.
"""

from __future__ import annotations

import itertools
from typing import Any


def percentile(xs: list[float], q: float) -> float | None:
    """The `q` quantile of `xs`, interpolated linearly (numpy's default); None when empty."""
    if not xs:
        return None
    ys = sorted(xs)
    pos = q * (len(ys) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def ema_within(latencies: list[float], limit: float, span: int) -> bool:
    """Whether the EMA of `latencies` (span `span`, bias-corrected as pandas' `ewm(span)
    .mean()`) stays below `limit` at every token."""
    decay = 1.0 - 2.0 / (span + 1)
    num = den = 0.0
    for x in latencies:
        num, den = x + decay * num, 1.0 + decay * den
        if num / den >= limit:
            return False
    return True


def cum_within(latencies: list[float], limit: float) -> bool:
    """Whether token i after the first arrives within (i+1) * `limit` of the first."""
    return all(t <= (i + 1) * limit for i, t in enumerate(itertools.accumulate(latencies)))


def summarize(run: dict[str, Any], sla: dict[str, float]) -> dict[str, Any]:
    """Throughput, TTFT and inter-token latency percentiles, and the requests/s that met
    `sla` (`ttft_s`, `decode_tokens_per_s`, `ema_span`) of one `drive` run."""
    recs = list(run["records"].values())
    ttft, itl, ok, ok_cum, tokens = [], [], 0, 0, 0
    end = 0.0
    per_token = 1.0 / sla["decode_tokens_per_s"]
    for r in recs:
        ts = r["times"]
        tokens += len(ts)
        if not ts:
            continue
        end = max(end, ts[-1])
        ttft.append(ts[0] - r["arrival"])
        gaps = [b - a for a, b in itertools.pairwise(ts)]
        itl += gaps
        if len(ts) == r["max_tokens"] and ts[0] - r["arrival"] <= sla["ttft_s"]:
            ok += ema_within(gaps, per_token, int(sla["ema_span"]))
            ok_cum += cum_within(gaps, per_token)
    start = min(r["arrival"] for r in recs)
    duration = max(end - start, 1e-9)
    pct = {f"p{int(q * 100)}": q for q in (0.5, 0.95, 0.99)}
    return {
        "requests": len(recs),
        "completed": sum(len(r["times"]) == r["max_tokens"] for r in recs),
        "met_sla": ok,
        "met_sla_cum": ok_cum,
        "duration_s": duration,
        "tokens_per_s": tokens / duration,
        "effective_rps": ok / duration,
        "effective_rps_cum": ok_cum / duration,
        "ttft_s": {k: percentile(ttft, q) for k, q in pct.items()},
        "itl_s": {k: percentile(itl, q) for k, q in pct.items()},
        "timed_out": run["timed_out"],
    }

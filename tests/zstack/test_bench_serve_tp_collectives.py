"""The per-layer collective benchmark (gloo's all-reduce vs the point-to-point one, 2 rank
processes) on a tiny size: both timed, the sums bit-identical (timings not asserted)."""

from __future__ import annotations

import pytest

from zstack.bench import load


@pytest.mark.slow(reason="2 rank processes importing torch and zserve: ~15-30 s on 2 cores")
def test_bench_serve_tp_collectives_tiny() -> None:
    bench = load("serve_tp_collectives")
    result = bench.run(hidden=8, rows="1,3", iters=5, repeats=1, gather_rows=2, gather_cols=10)
    assert result["collectives"] == "p2p"
    assert [r["rows"] for r in result["results"]] == [1, 3]
    assert all(r["same_sum"] and r["gloo_us"] > 0 and r["p2p_us"] > 0 for r in result["results"])
    assert result["gather"]["same"] and result["gather"]["p2p_us"] > 0
    assert "gloo/p2p" in bench.report(result)


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match=r"world 1 \(>= 2\)"):
        load("serve_tp_collectives").run(world=1)

"""`z bench pipe`: one tiny real 2-rank run, every contender in the JSON (timings not
asserted: benchmarks measure, tests check the plumbing)."""

from __future__ import annotations

import pytest

from zstack.bench import load


@pytest.mark.slow(reason="2 rank processes importing torch and ztrain: ~30 s on 2 cores")
def test_bench_pipe_tiny_two_ranks() -> None:
    bench = load("pipe")
    result = bench.run(steps=1, warmup=0, layers=2, width=32, seq=8, vocab=53, memory=False)
    assert result["benchmark"] == "pipe" and result["world_size"] == 2
    assert set(result["sides"]) == {"ours", "torch_1f1b", "ddp", "ours_zbv"}
    assert result["vs_torch_1f1b"] > 0 and result["vs_ddp"] > 0
    assert result["vs_torch_1f1b_paired"] > 0 and len(result["vs_torch_1f1b_per_step"]) == 1
    losses = {s: r["final_loss"] for s, r in result["sides"].items()}
    assert max(losses.values()) - min(losses.values()) < 1e-4, losses  # same init, same data
    assert result["sides"]["ours"]["bubble_theory_1f1b"] == pytest.approx(1 / 9)
    assert 0 <= result["sides"]["ours"]["bubble"] < 1
    assert "ours / torch 1F1B" in bench.report(result)

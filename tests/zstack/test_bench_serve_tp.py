"""`z bench serve --tp 2`: one tiny real run (the tiny random LLaMA), every contender in the
JSON (timings not asserted: benchmarks measure, tests check the plumbing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils.tiny_lm import write_tiny_lm
from zstack.bench import load


@pytest.mark.slow(reason="4 processes importing torch and zserve: ~30 s on 2 cores")
def test_bench_serve_tp_tiny(tmp_path: Path) -> None:
    bench = load("serve_tp")
    model = write_tiny_lm(tmp_path / "lm")
    result = bench.run(
        model_dir=str(model),
        prompt_tokens=8,
        decode_tokens=3,
        concurrent=2,
        rounds=1,
        repeats=1,
        peers="",
    )
    assert "errors" not in result, result.get("errors")
    polls = bench._qos_writable()  # then each tp also runs with idle cores the other way
    want = {"tp1", "tp1_1thread", "tp2", "tp2_gloo"} | (
        {"tp1_poll", "tp2_halt"} if polls else set()
    )
    assert set(result["batch1_tokens_per_s"]) == want
    assert result["batch1_ratio"] > 0 and result["concurrent_ratio"] > 0
    assert result["same_tokens"] is True  # point-to-point and gloo collectives, poll or halt
    assert set(result["vs_tp2_gloo"]) == {"batch1_tokens_per_s", "concurrent_tokens_per_s"}
    report = bench.report(result)
    assert "ratios: batch-1" in report
    assert "point-to-point collectives vs gloo's at tp=2" in report
    if polls:
        assert result["cpu_idle"]["tp2"] == "poll" and result["cpu_idle"]["tp2_halt"] == "halt"
        assert result["cpu_idle"]["tp1"] == "halt" and result["cpu_idle"]["tp1_poll"] == "poll"
        assert set(result["poll_vs_halt"]) == {"tp1", "tp2"}
        assert "tp2 polling vs halting idle cores" in report


@pytest.mark.slow(reason="4 processes importing torch and zserve, and a W4 quantization")
def test_bench_serve_tp_tiny_quantized_rows(tmp_path: Path) -> None:
    bench = load("serve_tp")
    model = write_tiny_lm(tmp_path / "lm")
    result = bench.run(
        model_dir=str(model),
        prompt_tokens=8,
        decode_tokens=3,
        concurrent=2,
        rounds=1,
        repeats=1,
        peers="",
        gloo=False,
        quantized="w4",
        quant_dir=str(tmp_path / "q"),
    )
    assert "errors" not in result, result.get("errors")
    assert {"tp1_w4", "tp2_w4"} <= set(result["batch1_tokens_per_s"])
    assert result["quantized"]["w4"]["same_tokens"] is True
    assert result["quantized"]["w4"]["batch1_ratio"] > 0
    assert "w4 tp=2 / tp=1" in bench.report(result)


@pytest.mark.slow(reason="6 processes importing torch (two of them transformers' tp ranks)")
def test_bench_serve_tp_tiny_with_transformers_tp_peer(tmp_path: Path) -> None:
    bench = load("serve_tp")
    model = write_tiny_lm(tmp_path / "lm")  # 4 query / 2 KV heads: transformers' plan cuts them
    result = bench.run(
        model_dir=str(model),
        prompt_tokens=8,
        decode_tokens=3,
        concurrent=2,
        rounds=1,
        repeats=1,
        peers="transformers",
        gloo=False,
    )
    assert "errors" not in result and "transformers_error" not in result, result
    assert set(result["vs_transformers"]) == {"batch1_tokens_per_s", "concurrent_tokens_per_s"}
    assert result["transformers_same_tokens"] is True  # the same greedy tokens as zserve's tp1
    assert "vs transformers tp_plan tp=2" in bench.report(result)


def test_unknown_peer_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown peer\(s\) \['vllm'\]"):
        load("serve_tp").run(peers="deepspeed,vllm")

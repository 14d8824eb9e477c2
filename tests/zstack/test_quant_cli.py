"""`z quantize`, `z eval` and `z bench quant` end to end on the real MiniLM."""

from __future__ import annotations

import json

import pytest

from tests.utils.models import minilm_dir
from tests.zstack.cli import run_z


def test_quantize_then_eval_embeddings(tmp_path):
    out = tmp_path / "minilm-w8"
    done = run_z("quantize", str(minilm_dir()), "--recipe", "w8", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "smaller than fp16" in done.stdout and (out / "zquant.json").is_file()
    manifest = json.loads((out / "zquant.json").read_text())
    assert manifest["recipe"]["name"] == "w8" and len(manifest["layers"]) == 36
    ev = run_z(
        "eval",
        str(out),
        "--embeddings",
        "--reference",
        str(minilm_dir()),
        "--sentences",
        "16",
        "--json",
    )
    assert ev.returncode == 0, ev.stderr
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert result["sentences"] == 16 and 0.999 <= result["cosine"] <= 1.0


def test_quantize_with_gptq_rounding(tmp_path):
    out = tmp_path / "minilm-w8-gptq"
    done = run_z(
        "quantize",
        str(minilm_dir()),
        "--recipe",
        "w8",
        "--gptq",
        "--gptq-sentences",
        "8",
        "--gptq-refits",
        "1",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert "with w8 + gptq" in done.stdout
    manifest = json.loads((out / "zquant.json").read_text())
    assert manifest["extra"]["gptq"] is True and len(manifest["layers"]) == 36
    assert manifest["extra"]["gptq_refits"] == 1
    both = run_z(
        "quantize",
        str(minilm_dir()),
        "--recipe",
        "w8",
        "--gptq",
        "--lkd",
        "--out",
        str(tmp_path / "x"),
    )
    assert both.returncode == 2 and "pick one" in both.stderr
    assert not (tmp_path / "x").exists()


def test_bad_input_fails_with_the_fix(tmp_path):
    bad = run_z(
        "quantize",
        str(minilm_dir()),
        "--recipe",
        "w4",
        "--group-size",
        "0",
        "--out",
        str(tmp_path / "x"),
    )
    assert bad.returncode == 2 and "group_size=0 must be a positive integer" in bad.stderr
    bad = run_z(
        "quantize",
        str(minilm_dir()),
        "--recipe",
        "w8",
        "--skip",
        "*.mlp.*",
        "--out",
        str(tmp_path / "x"),
    )
    assert bad.returncode == 2 and "pattern '*.mlp.*' matches none" in bad.stderr
    bad = run_z("quantize", str(tmp_path), "--recipe", "w8", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "no `config.json`" in bad.stderr
    bad = run_z("eval", str(minilm_dir()), "--ppl", str(tmp_path / "missing.txt"))
    assert bad.returncode == 2 and "missing.txt` not found" in bad.stderr
    bad = run_z("bench", "quant", "--gptq", "w6a16:32", "--json")
    assert bad.returncode == 2 and "`w6a16:g32`" in bad.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # ~100 s on the shared 2-core machine
def test_bench_quant_small_run_prints_json():
    done = run_z(
        "bench",
        "quant",
        "--recipes",
        "w8a8,w4",
        "--sentences",
        "40",
        "--no-smollm2",
        "--batches",
        "16",
        "--repeats",
        "3",
        "--lkd-steps",
        "1",
        "--xtc-steps",
        "0",
        "--gptq",
        "w8a8,w4:g64",
        "--gptq-sentences",
        "16",
        "--gptq-refits",
        "1",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = result["minilm"]["recipes"]
    assert set(rows) == {"w8a8", "w4", "w4+lkd", "w8a8+gptq", "w4:g64+gptq"}
    assert result["minilm"]["gptq"] == {"calib_sentences": 16, "scale_refits": 1}
    # groups of 64 instead of the recipe's 32: fewer scales, so a larger size ratio
    assert rows["w4:g64+gptq"]["linear_ratio_vs_fp16"] > rows["w4"]["linear_ratio_vs_fp16"]
    assert rows["w8a8"]["cosine"] > 0.99 and rows["w4"]["linear_ratio_vs_fp16"] > 3
    latency = result["latency"]["shapes"][0]["rows"]
    assert {r["batch"] for r in latency} == {16} and all(r["speedup"] > 0 for r in latency)

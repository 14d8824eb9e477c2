"""`z bench serve --compare llama.cpp --simd avx2`: the comparison runs in a child forced to
AVX2 (znative, torch and its GEMM libraries), and the JSON records both sides' SIMD paths;
a level we cannot force is named. Plumbing on the tiny model; the peer is not installed here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils.tiny_lm import write_tiny_lm
from zstack.bench import load

Z = str(Path(sys.executable).parent / "z")


@pytest.mark.slow(reason="z and its forced child each import torch and zserve (~25-50 s)")
def test_simd_avx2_forces_both_libraries_and_records_them(tmp_path: Path) -> None:
    znative = pytest.importorskip("znative")
    if znative.detected_simd_level() == "scalar":
        pytest.skip("this CPU has no AVX2")
    lm = write_tiny_lm(tmp_path / "tiny")
    args = ["--precisions", "fp32", "--prompt-tokens", "8", "--decode-tokens", "3"]
    args += ["--concurrent", "2", "--repeats", "1", "--simd", "avx2", "--json"]
    out = subprocess.run(
        [Z, "bench", "serve", str(lm), "--compare", "llama.cpp", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": "", "LLAMACPP_AVX2_DIR": str(tmp_path / "none")},
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    simd = r["simd"]
    assert simd["requested"] == "avx2" and simd["znative"] == "avx2"
    assert simd["torch"] == "AVX2"
    assert simd["env"]["ATEN_CPU_CAPABILITY"] == "avx2"
    assert simd["env"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert r["options"]["simd"] == "avx2"
    assert "make llama-cpp-avx2" in r["peer"].get("install", "make llama-cpp-avx2")
    assert all(v > 0 for v in r["rows"]["fp32"]["zserve"].values())


def test_unknown_simd_level_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="forceable levels are avx2"):
        load("_serve_compare").run_compare(tmp_path, simd="sse9")


def test_a_peer_built_with_avx512_is_refused_at_avx2() -> None:
    simd = load("_serve_simd")
    line = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 |"
    why = simd.peer_refusal("avx2", {"system_info": line, "path": "/x"})
    assert why is not None and "make llama-cpp-avx2" in why
    assert simd.peer_refusal("avx2", {"system_info": "AVX2 = 1 | AVX512 = 0"}) is None
    assert simd.peer_refusal(None, {"system_info": line}) is None

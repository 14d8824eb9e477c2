"""`z bench adam` end to end on a small size: one JSON object last, every
contender and the ceiling measured in the same run, and a clear error for bad
options. Timings are not asserted (benchmarks measure; tests check behaviour)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

Z = str(Path(sys.executable).parent / "z")


def run_z(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([Z, *args], capture_output=True, text=True, timeout=300)


def test_bench_adam_prints_one_json_object_with_baselines():
    out = run_z(
        "bench",
        "adam",
        "--numel",
        "200000",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--dtype",
        "bf16-states",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "adam" and result["numel"] == 200000
    names = set(result["results"])
    assert {
        "zstack_cpu_adam",
        "zstack_cpu_adam_fp32",
        "torch_adam_fused",
        "torch_adam_foreach",
    } <= names
    for r in result["results"].values():
        assert r["median_step_s"] > 0 and r["params_per_s"] > 0 and r["gb_per_s"] > 0
    assert result["results"]["zstack_cpu_adam"]["bytes_per_param"] == 20
    assert result["results"]["torch_adam_fused"]["bytes_per_param"] == 28
    for c in (result["ceiling"], result["bf16_states_ceiling"]):
        # every pace is timed, and the ceiling is the fastest of them
        assert set(c["gb_per_s_by_pace"]) == {"0", "1", "2"}
        assert c["gb_per_s"] == max(c["gb_per_s_by_pace"].values()) > 0
        assert c["gb_per_s_by_pace"][str(c["pace"])] == c["gb_per_s"]
    assert result["bf16_states_ceiling"]["speedup_bound"] > 0
    assert result["results"]["zstack_cpu_adam"]["fraction_of_bf16_states_ceiling"] > 0
    assert set(result["speedup_of_ours"]) == {f"vs_{n}" for n in names - {"zstack_cpu_adam"}}
    assert set(result["speedup_of_ours_per_round_median"]) == set(result["speedup_of_ours"])
    assert result["machine"]["simd"] in ("avx512", "avx2", "scalar")
    assert isinstance(result["deepspeed_cpu_adam"], str)


def test_bench_adam_human_report_then_json():
    out = run_z("bench", "adam", "--numel", "50000", "--steps", "2", "--warmup", "0")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "ceiling (stream 4r/3w)" in out.stdout and "torch_adam_fused" in out.stdout
    assert "bf16_states_ceiling" not in json.loads(lines[-1])  # fp32 runs have one probe


def test_bench_adam_rejects_unknown_dtype():
    out = run_z("bench", "adam", "--numel", "1000", "--dtype", "fp64")
    assert out.returncode != 0
    assert "fp64" in out.stderr and "bf16-states" in out.stderr


def test_a_benchmark_module_is_executed_once_per_process():
    from zstack.bench import load

    first = load("adam")
    assert load("adam") is first and callable(first.run)


def test_unknown_benchmark_names_the_known_ones():
    from zstack.bench import load

    try:
        load("nope")
    except FileNotFoundError as e:
        assert "adam" in str(e)
    else:
        raise AssertionError("load('nope') did not raise")

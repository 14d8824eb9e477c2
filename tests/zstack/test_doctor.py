"""`z doctor`: the real command, on this machine, in both output forms."""

from __future__ import annotations

import ctypes
import errno
import importlib
import json
import os
import platform
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import znative
from zstack import doctor, probes

Z = Path(sys.executable).parent / "z"


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess[str]]:
    """`z doctor --json` and `z doctor`, started together (each imports torch: seconds), with
    ``ZNATIVE_NUM_THREADS`` set to this process's pool size: a test that ran earlier in this
    worker may have left the variable set to another value after this pool started."""
    env = {**os.environ, "ZNATIVE_NUM_THREADS": str(znative.num_threads())}
    procs = {
        name: subprocess.Popen(
            [str(Z), "doctor", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, flags in (("json", ["--json"]), ("human", []))
    }
    done = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


@pytest.fixture(scope="module")
def report(runs: dict[str, subprocess.CompletedProcess[str]]) -> dict[str, Any]:
    run = runs["json"]
    assert run.returncode == 0, run.stderr
    # Exactly one JSON object on stdout: json.loads rejects anything before or after it.
    parsed = json.loads(run.stdout)
    assert isinstance(parsed, dict)
    return parsed


def test_json_has_every_section(report: dict[str, Any]) -> None:
    expected = {
        "packages",
        "python",
        "torch",
        "gpu",
        "cpu",
        "io_uring",
        "nvrtc",
        "cupy",
        "problems",
    }
    assert expected <= report.keys()
    assert report["python"]["version"] == platform.python_version()
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["cuda"] == torch.version.cuda
    assert isinstance(report["io_uring"]["available"], bool)
    assert report["nvrtc"]["status"] in {"ok", "missing", "unknown"}
    assert report["cupy"]["status"] in {"ok", "missing", "unknown"}


def test_package_versions_match_modules(report: dict[str, Any]) -> None:
    assert list(report["packages"]) == list(doctor.PACKAGES)
    for name, entry in report["packages"].items():
        module = importlib.import_module(name)
        assert entry["installed"] is True
        assert entry["version"] == module.__version__, name


def test_simd_matches_native_core(report: dict[str, Any]) -> None:
    cpu = report["cpu"]
    assert cpu["simd_detected"] in {"avx512", "avx2", "scalar"}
    assert cpu["simd_detected"] == znative.detected_simd_level()
    assert cpu["simd_active"] == znative.simd_level()
    assert cpu["kernel_threads"] == znative.num_threads(), cpu
    assert cpu["env"]["ZNATIVE_NUM_THREADS"] == str(znative.num_threads()), cpu
    assert 1 <= cpu["usable_cores"] <= cpu["logical_cores"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU report")
def test_no_gpu_is_reported_with_reason(report: dict[str, Any]) -> None:
    gpu = report["gpu"]
    assert gpu["available"] is False
    assert "GPU kernels unavailable" in gpu["reason"] or "torch" in gpu["reason"]
    problem = next(p for p in report["problems"] if p["item"] == "gpu")
    assert problem["fix"]


def test_every_problem_has_a_fix(report: dict[str, Any]) -> None:
    for problem in report["problems"]:
        assert problem["severity"] in {"error", "warning", "info"}
        assert problem["message"] and problem["fix"], problem
    # Nothing required is missing in this environment, so no problem is an error.
    assert not [p for p in report["problems"] if p["severity"] == "error"]


def test_human_output(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    run = runs["human"]
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    simd = next(line for line in lines if line.startswith("simd "))
    assert znative.simd_level() in simd
    for name in doctor.PACKAGES:
        assert any(line.split()[:1] == [name] for line in lines), name
    if not torch.cuda.is_available():
        assert any(line.startswith("gpu ") and "none:" in line for line in lines)
        assert "  fix: " in run.stdout


def test_forced_simd_level_is_a_warning_with_fix() -> None:
    detected = znative.detected_simd_level()
    if detected == "scalar":
        pytest.skip("the CPU has no SIMD level above scalar to force down from")
    znative.set_simd_level("scalar")
    try:
        report = doctor.collect()
    finally:
        znative.set_simd_level(None)
    assert report["cpu"]["simd_active"] == "scalar"
    assert report["cpu"]["simd_detected"] == detected
    problem = next(p for p in report["problems"] if p["item"] == "simd")
    assert problem["severity"] == "warning"
    assert problem["fix"].endswith(f"to use {detected}")


def test_a_bad_znative_simd_is_reported_not_a_crash() -> None:
    """znative refuses an unknown ZNATIVE_SIMD at import; doctor (a fresh process, so
    the import really happens) reports it with the fix instead of dying in a probe."""
    env = {**os.environ, "ZNATIVE_SIMD": "avx9"}
    run = subprocess.run(
        [str(Z), "doctor", "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert "Traceback" not in run.stderr, run.stderr
    assert run.returncode == 1  # an error was found
    report = json.loads(run.stdout)
    problem = next(p for p in report["problems"] if p["item"] == "znative")
    assert "avx9" in problem["message"] and problem["severity"] == "error"
    assert problem["fix"].startswith("unset ZNATIVE_SIMD or set it to a level this CPU has")
    assert (
        report["nvrtc"]["status"] == "unknown"
        and "znative does not import" in (report["nvrtc"]["reason"])
    )


def test_missing_package_is_an_error_and_fails_the_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        if name == "zmoe":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert doctor.main(json_out=True) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["packages"]["zmoe"] == {"installed": False, "version": None}
    problem = next(p for p in report["problems"] if p["item"] == "zmoe")
    assert problem["severity"] == "error"
    assert "packages/zmoe" in problem["fix"]


def _fake_nvml(driver_cuda: int) -> types.ModuleType:
    """A stand-in `pynvml` that sees one H100 behind a driver for CUDA `driver_cuda`."""
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        value = 999

    fake.NVMLError = NVMLError
    fake.NVML_ERROR_LIBRARY_NOT_FOUND, fake.NVML_ERROR_DRIVER_NOT_LOADED = 12, 9
    fake.nvmlInit = fake.nvmlShutdown = lambda: None
    fake.nvmlSystemGetCudaDriverVersion = lambda: driver_cuda
    fake.nvmlSystemGetDriverVersion = lambda: "550.54.15"
    fake.nvmlDeviceGetCount = lambda: 1
    fake.nvmlDeviceGetHandleByIndex = lambda index: index
    fake.nvmlDeviceGetName = lambda handle: b"NVIDIA H100 80GB HBM3"
    fake.nvmlDeviceGetCudaComputeCapability = lambda handle: (9, 0)
    fake.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(total=80 * 2**30)
    return fake


@pytest.mark.parametrize(
    ("torch_cuda", "reason", "fix"),
    [
        (
            "13.2",
            "driver supports CUDA 12.4 but torch was built for CUDA 13.2",
            "update the NVIDIA driver",
        ),
        (None, "torch is a CPU-only build", "install a CUDA build of torch"),
    ],
)
def test_gpu_present_but_unusable_names_the_cause(
    monkeypatch: pytest.MonkeyPatch, torch_cuda: str | None, reason: str, fix: str
) -> None:
    # No GPU here: NVML is faked to check how a driver/torch mismatch is explained.
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(driver_cuda=12040))
    problems: list[probes.Problem] = []
    torch_info = {"installed": True, "cuda": torch_cuda, "cuda_available": False}
    gpu = probes.gpu(torch_info, problems)
    assert gpu["available"] is False
    assert gpu["driver_version"] == "550.54.15" and gpu["driver_cuda"] == "12.4"
    assert gpu["gpus"] == [
        {
            "index": 0,
            "name": "NVIDIA H100 80GB HBM3",
            "memory_gib": 80.0,
            "compute_capability": "9.0",
        }
    ]
    assert gpu["reason"] == reason
    assert [(p.item, p.severity) for p in problems] == [("gpu", "warning")]
    assert problems[0].fix.startswith(fix)


@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine().lower() not in {"x86_64", "aarch64"},
    reason="io_uring is probed on Linux x86_64/aarch64 only",
)
def test_io_uring_refused_by_seccomp_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object) -> int:
        """libc's `syscall` as under a seccomp filter that denies io_uring."""
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(
        probes.ctypes, "CDLL", lambda *a, **k: types.SimpleNamespace(syscall=refused)
    )
    problems: list[probes.Problem] = []
    info = probes.io_uring(problems)
    assert info["available"] is False
    assert info["errno"] == "EPERM"
    assert "seccomp" in info["reason"]
    (problem,) = problems
    assert (problem.item, problem.severity) == ("io_uring", "warning")
    if not info["sysctl_io_uring_disabled"]:
        assert "seccomp" in problem.fix


def test_io_uring_reports_the_async_io_engine_backend(report: dict[str, Any]) -> None:
    import znative

    name, reason = znative.io_backend_probe()
    assert report["io_uring"]["engine"] == {"backend": name, "reason": reason}
    assert name in {"io_uring", "threads"}
    if name == "threads":
        assert reason.startswith("io_uring_setup failed")

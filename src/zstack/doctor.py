"""`z doctor`: what this machine can run, and the one command that fixes each gap.

Like DeepSpeed's `ds_report`, but every item that is missing or degraded comes
with a fix. Checks: package versions, python, torch and its CUDA build, NVIDIA
GPUs through NVML, the native core's SIMD level and thread pool, the CPU,
io_uring (for NVMe offload), NVRTC and CuPy (for the CUDA kernels).

Nothing here may raise: each probe turns its failure into data and, where it
matters, a `Problem`. Exit status is 0 unless a required part of zstack (one
of its packages, or torch) is missing or fails to import.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import os
import platform
import sys
import warnings
from dataclasses import asdict
from typing import Any

from zstack import probes
from zstack.probes import Problem, Severity

PACKAGES = ("zstack", "znative", "zcore", "zoffload", "zcomm", "zquant", "zmoe", "zserve")


def _cuda_extra(torch_cuda: str | None) -> str:
    """The `znative[...]` extra matching torch's CUDA major version (CuPy must share it)."""
    return "cuda13" if torch_cuda and torch_cuda.split(".")[0] == "13" else "cuda12"


def _packages(problems: list[Problem]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in PACKAGES:
        fix = (
            "run `make setup` in the zstack checkout"
            if name in ("zstack", "znative")
            else f"run `uv pip install --no-deps -e packages/{name}` in the zstack checkout "
            f"(not `pip install {name}`: that name on PyPI may be another project)"
        )
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = {"installed": False, "version": None}
            problems.append(Problem(name, "error", "not installed", fix))
            continue
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # any import failure is a finding, not a crash
            out[name] = {"installed": True, "version": version, "import_error": repr(exc)}
            problems.append(
                Problem(name, "error", f"`import {name}` fails: {exc!r}", _import_fix(exc, fix))
            )
            continue
        module_version = getattr(module, "__version__", None)
        out[name] = {"installed": True, "version": version, "module_version": module_version}
        if module_version != version:
            problems.append(
                Problem(
                    name,
                    "warning",
                    f"installed metadata says {version} but `{name}.__version__` is "
                    f"{module_version}: the install is stale",
                    fix,
                )
            )
    return out


def _import_fix(exc: BaseException, fix: str) -> str:
    """The fix for a failed import: a bad ``ZNATIVE_SIMD`` (znative refuses it at import)
    is fixed in the environment, not by reinstalling."""
    if type(exc).__name__ == "SimdError" and os.environ.get("ZNATIVE_SIMD"):
        try:
            from znative._native import detected_simd_level

            best = f" (this CPU's best is `{detected_simd_level()}`)"
        except Exception:
            best = ""
        return f"unset ZNATIVE_SIMD or set it to a level this CPU has{best}"
    return fix


def _python() -> dict[str, Any]:
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
    }


def _torch(problems: list[Problem]) -> dict[str, Any]:
    try:
        import torch
    except Exception as exc:
        problems.append(
            Problem("torch", "error", f"`import torch` fails: {exc!r}", "run `pip install torch`")
        )
        return {"installed": False, "version": None, "cuda": None, "cuda_available": False}
    # torch reports a driver/build mismatch as a warning; keep it as the reason instead.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = bool(torch.cuda.is_available())
    return {
        "installed": True,
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": available,
        "device_count": torch.cuda.device_count() if available else 0,
        "cuda_warnings": [str(w.message) for w in caught],
    }


_UNKNOWN_CUDA = "this znative has no `znative.cuda` module"
_UNKNOWN_FIX = "reinstall znative from the zstack checkout: `make setup`"


def _no_cuda_module(exc: BaseException) -> tuple[str, str]:
    """Why ``znative.cuda`` is not there, and the fix."""
    if isinstance(exc, ImportError) and "znative.cuda" in str(exc):
        return _UNKNOWN_CUDA, _UNKNOWN_FIX
    return f"znative does not import ({exc})", "fix the znative problem reported above"


def _nvrtc(torch_cuda: str | None, problems: list[Problem]) -> dict[str, Any]:
    try:
        from znative.cuda import nvrtc
    except Exception as exc:  # not built in, or znative itself fails to import
        reason, fix = _no_cuda_module(exc)
        problems.append(Problem("nvrtc", "info", f"unknown: {reason}", fix))
        return {"status": "unknown", "path": None, "version": None, "reason": reason}
    try:
        path = nvrtc.find_nvrtc()
        version = nvrtc.version() if path else None
    except Exception as exc:
        path, version, error = None, None, repr(exc)
    else:
        error = None
    if path and version:
        return {
            "status": "ok",
            "path": path,
            "version": f"{version[0]}.{version[1]}",
            "reason": None,
        }
    package = (
        "nvidia-cuda-nvrtc" if _cuda_extra(torch_cuda) == "cuda13" else "nvidia-cuda-nvrtc-cu12"
    )
    reason = error or ("NVRTC library found but unusable" if path else "no NVRTC library found")
    problems.append(
        Problem(
            "nvrtc",
            "warning",
            f"{reason}: `.cu` kernels cannot be compiled",
            f"run `pip install {package}`",
        )
    )
    return {"status": "missing", "path": path, "version": None, "reason": reason}


def _cupy(torch_cuda: str | None, gpu_available: bool, problems: list[Problem]) -> dict[str, Any]:
    try:
        from znative.cuda import cupy_status
    except Exception as exc:  # not built in, or znative itself fails to import
        reason, fix = _no_cuda_module(exc)
        problems.append(Problem("cupy", "info", f"unknown: {reason}", fix))
        return {"status": "unknown", "detail": reason}
    try:
        ok, detail = cupy_status()
    except Exception as exc:
        ok, detail = False, repr(exc)
    if ok:
        return {"status": "ok", "detail": detail}
    # Without a GPU CuPy has nothing to run on, so its absence is expected there.
    severity: Severity = "warning" if gpu_available else "info"
    problems.append(
        Problem(
            "cupy",
            severity,
            # znative's detail ends in its own install hint; the fix below picks the CUDA major.
            f"{detail.split(';')[0]}: GPU kernels unavailable",
            f"run `pip install znative[{_cuda_extra(torch_cuda)}]`",
        )
    )
    return {"status": "missing", "detail": detail}


def collect() -> dict[str, Any]:
    """Run every probe and return the report as one JSON-serializable dict."""
    problems: list[Problem] = []
    # Keep stdout for the report alone: nothing an import prints may corrupt `--json`.
    with contextlib.redirect_stdout(sys.stderr):
        packages = _packages(problems)
        torch_info = _torch(problems)
        gpu = probes.gpu(torch_info, problems)
        cpu = probes.cpu(problems)
        io_uring = probes.io_uring(problems)
        nvrtc = _nvrtc(torch_info.get("cuda"), problems)
        cupy = _cupy(torch_info.get("cuda"), gpu["available"], problems)
    return {
        "packages": packages,
        "python": _python(),
        "torch": torch_info,
        "gpu": gpu,
        "cpu": cpu,
        "io_uring": io_uring,
        "nvrtc": nvrtc,
        "cupy": cupy,
        "problems": [asdict(p) for p in problems],
    }


def render(report: dict[str, Any]) -> str:
    """The human-readable report: one aligned row per item, then each problem and its fix."""
    rows: list[tuple[str, str]] = []
    for name, pkg in report["packages"].items():
        broken = " (import fails)" if "import_error" in pkg else ""
        rows.append((name, f"{pkg['version']}{broken}" if pkg["installed"] else "not installed"))
    py, torch_info = report["python"], report["torch"]
    rows.append(("python", f"{py['version']} ({py['executable']})"))
    if torch_info["installed"]:
        cuda = torch_info["cuda"] or "none: cpu build"
        rows.append(("torch", f"{torch_info['version']} (cuda {cuda})"))
    else:
        rows.append(("torch", "not installed"))
    gpu = report["gpu"]
    for g in gpu.get("gpus") or []:
        summary = f"{g['name']}, {g['memory_gib']} GiB, sm {g['compute_capability']}"
        rows.append((f"gpu {g['index']}", summary))
    if gpu.get("driver_version"):
        rows.append(("driver", f"{gpu['driver_version']} (cuda {gpu['driver_cuda']})"))
    rows.append(("gpu", "available" if gpu["available"] else f"none: {gpu['reason']}"))
    cpu = report["cpu"]
    cores = f"{cpu['usable_cores']} of {cpu['logical_cores']} cores usable"
    rows.append(("cpu", f"{cpu['model']} ({cpu['arch']}), {cores}"))
    if cpu["simd_active"]:
        rows.append(("simd", f"{cpu['simd_active']} (detected {cpu['simd_detected']})"))
        rows.append(("threads", f"{cpu['kernel_threads']} kernel threads"))
    ring, nvrtc, cupy = report["io_uring"], report["nvrtc"], report["cupy"]
    rows.append(
        ("io_uring", "available" if ring["available"] else f"unavailable: {ring['reason']}")
    )
    engine = ring.get("engine") or {}
    if engine.get("backend"):
        rows.append(("async io", f"{engine['backend']} backend ({engine['reason']})"))
    else:
        rows.append(("async io", f"unavailable: {engine.get('reason', 'not probed')}"))
    if nvrtc["status"] == "ok":
        rows.append(("nvrtc", f"{nvrtc['version']} ({nvrtc['path']})"))
    else:
        rows.append(("nvrtc", f"{nvrtc['status']}: {nvrtc['reason']}"))
    rows.append(("cupy", f"{cupy['status']}: {cupy['detail'].split(';')[0]}"))

    width = max(len(label) for label, _ in rows) + 2
    lines = [f"{label:<{width}}{value}" for label, value in rows]
    if not report["problems"]:
        lines += ["", "no problems found"]
    for p in report["problems"]:
        lines += ["", f"{p['severity']}: {p['item']}: {p['message']}", f"  fix: {p['fix']}"]
    return "\n".join(lines)


def main(json_out: bool) -> int:
    """Print the report (or, with `json_out`, exactly one JSON object) and return the exit code:
    1 if a required part of zstack is missing or broken, else 0."""
    report = collect()
    if json_out:
        print(json.dumps(report))
    else:
        print(render(report))
    return 1 if any(p["severity"] == "error" for p in report["problems"]) else 0

"""Hardware probes of `z doctor`: GPUs through NVML, the CPU and the native
core's SIMD level and threads, and io_uring. Each probe returns plain data and
appends a `Problem` (with its fix) for anything missing or degraded; none raises."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import sys
from dataclasses import dataclass
from typing import Any, Literal

# `io_uring_setup` has the same number on every architecture that gained it in Linux 5.1.
_IO_URING_SETUP = 425
_IO_URING_ARCHES = {"x86_64", "amd64", "aarch64", "arm64"}
_IO_URING_PARAMS_SIZE = 120  # sizeof(struct io_uring_params)

Severity = Literal["error", "warning", "info"]


@dataclass
class Problem:
    """One missing or degraded item: `error` breaks zstack, `warning` slows or limits it,
    `info` is an optional feature this machine does not have."""

    item: str
    severity: Severity
    message: str
    fix: str


def nvml() -> dict[str, Any]:
    """Driver and GPUs as NVML sees them, independent of how torch was built."""
    try:
        import pynvml
    except ImportError:
        return {
            "driver": False,
            "reason": "nvidia-ml-py not installed",
            "fix": "run `pip install nvidia-ml-py`",
        }
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        no_driver = (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        if getattr(exc, "value", None) in no_driver:
            return {"driver": False, "reason": "no NVIDIA driver"}
        return {"driver": False, "reason": f"NVML failed to start: {exc}"}
    try:
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(
                {
                    "index": index,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "memory_gib": round(pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30, 1),
                    "compute_capability": f"{major}.{minor}",
                }
            )
        version = pynvml.nvmlSystemGetDriverVersion()
        return {
            "driver": True,
            "driver_version": version.decode() if isinstance(version, bytes) else version,
            "driver_cuda": f"{cuda // 1000}.{cuda % 1000 // 10}",
            "gpus": gpus,
        }
    except pynvml.NVMLError as exc:
        return {"driver": True, "reason": f"NVML query failed: {exc}", "gpus": []}
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def version_tuple(text: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in (text or "").split("."))
    except ValueError:
        return ()


def gpu(torch_info: dict[str, Any], problems: list[Problem]) -> dict[str, Any]:
    found = nvml()
    gpu: dict[str, Any] = {"available": torch_info["cuda_available"], **found}
    gpu.pop("fix", None)
    if gpu["available"]:
        gpu["reason"] = None
        return gpu
    torch_cuda = torch_info.get("cuda")
    if not found["driver"]:
        reason = f"{found['reason']}: GPU kernels unavailable; CPU paths work"
        fix = (
            found.get("fix")
            or "nothing to do for CPU-only use; GPU kernels need an NVIDIA GPU and driver"
        )
        severity: Severity = "warning" if "fix" in found else "info"
    elif not found.get("gpus"):
        reason = found.get("reason") or "NVIDIA driver loaded but no GPU visible"
        fix, severity = "check `nvidia-smi` and `CUDA_VISIBLE_DEVICES`", "warning"
    elif not torch_info["installed"]:
        reason, fix, severity = "torch is not installed", "run `pip install torch`", "warning"
    elif torch_cuda is None:
        reason = "torch is a CPU-only build"
        fix = "install a CUDA build of torch (https://pytorch.org/get-started/locally/)"
        severity = "warning"
    elif version_tuple(found["driver_cuda"]) < version_tuple(torch_cuda):
        reason = (
            f"driver supports CUDA {found['driver_cuda']} but torch was built for CUDA {torch_cuda}"
        )
        fix = (
            f"update the NVIDIA driver to one for CUDA {torch_cuda}, "
            f"or install a torch build for CUDA {found['driver_cuda']}"
        )
        severity = "warning"
    else:
        detail = "; ".join(torch_info.get("cuda_warnings") or []) or "unknown cause"
        reason = f"torch cannot use the GPU: {detail}"
        fix, severity = "run `nvidia-smi`; check `CUDA_VISIBLE_DEVICES`", "warning"
    gpu["reason"] = reason
    problems.append(Problem("gpu", severity, reason, fix))
    return gpu


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "cpu model", "hardware")):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu(problems: list[Problem]) -> dict[str, Any]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu: dict[str, Any] = {
        "model": cpu_model(),
        "arch": platform.machine(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "simd_detected": None,
        "simd_active": None,
        "kernel_threads": None,
        "env": {k: os.environ.get(k) for k in ("ZNATIVE_SIMD", "ZNATIVE_NUM_THREADS")},
    }
    try:
        import znative

        cpu["simd_detected"] = znative.detected_simd_level()
        cpu["simd_active"] = znative.simd_level()
        cpu["kernel_threads"] = znative.num_threads()
    except Exception:  # reported once, under packages
        return cpu
    detected, active = cpu["simd_detected"], cpu["simd_active"]
    if detected == "scalar" and cpu["arch"] in ("x86_64", "amd64"):
        problems.append(
            Problem(
                "simd",
                "warning",
                "CPU has neither AVX2 nor AVX-512: native kernels run scalar code",
                "run on a CPU with AVX2 or AVX-512 for the fast CPU kernels",
            )
        )
    if active != detected:
        forced_by = cpu["env"]["ZNATIVE_SIMD"]
        if forced_by:
            message = (
                f"`ZNATIVE_SIMD={forced_by}` forces {active} although the CPU supports {detected}"
            )
            fix = f"unset `ZNATIVE_SIMD` to use {detected}"
        else:
            message = (
                f"`znative.set_simd_level` forced {active} although the CPU supports {detected}"
            )
            fix = f"call `znative.set_simd_level(None)` to use {detected}"
        problems.append(Problem("simd", "warning", message, fix))
    if usable and cpu["kernel_threads"] > usable:
        problems.append(
            Problem(
                "threads",
                "warning",
                f"{cpu['kernel_threads']} kernel threads on {usable} usable cores oversubscribes the CPU",
                f"set `ZNATIVE_NUM_THREADS={usable}` or fewer",
            )
        )
    return cpu


IO_URING_ERRNO = {
    errno.EPERM: "blocked by `kernel.io_uring_disabled` or a seccomp filter",
    errno.ENOSYS: "kernel without io_uring (needs Linux 5.1+) or blocked by seccomp",
    errno.ENOMEM: "locked-memory limit too low for a ring",
    errno.EMFILE: "out of file descriptors",
}


def _engine_backend() -> dict[str, Any]:
    """The backend znative's async IO engine picks with `backend="auto"`, and why."""
    try:
        from znative import io_backend_probe
    except Exception as e:  # missing, or znative refuses to import (a bad ZNATIVE_SIMD)
        return {"backend": None, "reason": f"znative without async IO: {e}"}
    name, reason = io_backend_probe()
    return {"backend": name, "reason": reason}


def io_uring(problems: list[Problem]) -> dict[str, Any]:
    """Probe by creating (and closing) a 1-entry ring: the only test that sees seccomp too.
    `engine` says which backend znative's async IO picks here (io_uring or threads) and why."""
    info: dict[str, Any] = {"available": False, "sysctl_io_uring_disabled": None, "errno": None}
    info["engine"] = _engine_backend()
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/sys/kernel/io_uring_disabled", encoding="ascii") as f:
            info["sysctl_io_uring_disabled"] = int(f.read().strip())
    machine = platform.machine().lower()
    if sys.platform != "linux" or machine not in _IO_URING_ARCHES:
        info["reason"] = f"not probed on {sys.platform}/{machine}"
        problems.append(
            Problem("io_uring", "info", info["reason"], "NVMe offload uses io_uring on Linux only")
        )
        return info
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    params = (ctypes.c_ubyte * _IO_URING_PARAMS_SIZE)()
    fd = libc.syscall(ctypes.c_long(_IO_URING_SETUP), ctypes.c_long(1), ctypes.byref(params))
    if fd >= 0:
        os.close(fd)
        info.update(available=True, reason=None)
        return info
    err = ctypes.get_errno()
    info["errno"] = errno.errorcode.get(err, str(err))
    info["reason"] = (
        f"io_uring_setup: {info['errno']} ({IO_URING_ERRNO.get(err, os.strerror(err))})"
    )
    if info["sysctl_io_uring_disabled"]:
        fix = "run `sudo sysctl -w kernel.io_uring_disabled=0`"
    elif err == errno.ENOMEM:
        fix = "raise the locked-memory limit (`ulimit -l`)"
    elif err in (errno.EPERM, errno.ENOSYS):
        fix = "allow io_uring in the container's seccomp profile (docker: `--security-opt seccomp=...`)"
    else:
        fix = f"see `man 2 io_uring_setup` for {info['errno']}"
    message = f"{info['reason']}: NVMe offload IO cannot use io_uring"
    if info["engine"]["backend"] == "threads":
        message += " (znative's async IO runs on its thread-pool backend)"
    problems.append(Problem("io_uring", "warning", message, fix))
    return info

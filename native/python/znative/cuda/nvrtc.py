"""Compile CUDA C++ to CUBIN with NVRTC, without CuPy, torch or a GPU.

A thin ctypes binding to ``libnvrtc``: enough to compile-check the kernels that
ship in ``znative/cuda/kernels`` for any architecture NVRTC supports, on a
machine with no CUDA driver. The library comes from, in order: the
``ZNATIVE_NVRTC`` environment variable (a path), an NVIDIA wheel on ``sys.path``
(``nvidia-cuda-nvrtc`` for CUDA 13, which torch's CUDA 13 wheels bring, or
``nvidia-cuda-nvrtc-cu12``), a CUDA toolkit under ``CUDA_HOME``/``CUDA_PATH``,
then the system loader's search.

Kernels are loaded at run time by :func:`znative.cuda.load_module` (through
CuPy); this module exists so that every ``.cu`` file is checked in CI.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "INSTALL_HINT",
    "CompileError",
    "NVRTCNotFoundError",
    "compile_file",
    "compile_source",
    "find_nvrtc",
    "supported_archs",
    "version",
]

INSTALL_HINT = (
    "install NVRTC with `pip install nvidia-cuda-nvrtc` (CUDA 13) or "
    "`pip install nvidia-cuda-nvrtc-cu12` (CUDA 12), or point `ZNATIVE_NVRTC` at a libnvrtc.so"
)

# Wheel layouts, newest CUDA first: the first match on any sys.path entry wins.
_WHEEL_PATTERNS = (
    "nvidia/cu13/lib/libnvrtc.so.13",
    "nvidia/cuda_nvrtc/lib/libnvrtc.so.13",
    "nvidia/cu12/lib/libnvrtc.so.12",
    "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
    "nvidia/*/lib/libnvrtc.so.*[0-9]",
    "nvidia/*/bin/nvrtc64_*.dll",
)

_NVRTC_SUCCESS = 0
_NVRTC_ERROR_COMPILATION = 6  # a source error: the log says everything


class NVRTCNotFoundError(ImportError):
    """No loadable ``libnvrtc`` was found; the message says how to install one."""


class CompileError(RuntimeError):
    """NVRTC rejected a source. ``log`` holds the compiler's full output."""

    def __init__(self, name: str, arch: str, log: str, detail: str = "compilation failed"):
        self.name = name
        self.arch = arch
        self.log = log
        super().__init__(f"nvrtc: {name} for {arch}: {detail}\n{log}".rstrip())


def find_nvrtc() -> str | None:
    """Return the path (or loader name) of the NVRTC library to use, or None if none exists."""
    env = os.environ.get("ZNATIVE_NVRTC")
    if env:
        return env
    for pattern in _WHEEL_PATTERNS:
        for entry in sys.path:
            if not entry or not os.path.isdir(entry):
                continue
            hits = sorted(glob.glob(os.path.join(entry, pattern)), reverse=True)
            if hits:
                return hits[0]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root:
            hits = sorted(glob.glob(os.path.join(root, "lib*", "libnvrtc.so*")), reverse=True)
            if hits:
                return hits[0]
    return ctypes.util.find_library("nvrtc")


@functools.lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL, Path | None]:
    """Load NVRTC once; return it with the CUDA include dir beside it, if there is one."""
    path = find_nvrtc()
    if path is None:
        raise NVRTCNotFoundError(f"NVRTC (libnvrtc) was not found; {INSTALL_HINT}")
    lib_dir = Path(path).parent if os.path.sep in path else None
    if lib_dir is not None:
        # libnvrtc dlopens libnvrtc-builtins by soname; a wheel's lib dir is not on the
        # loader's path, so load the builtins from the same dir first.
        for builtins in sorted(lib_dir.glob("libnvrtc-builtins.so*"), reverse=True):
            try:
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
                break
            except OSError:
                continue
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise NVRTCNotFoundError(
            f"NVRTC at {path} could not be loaded ({exc}); {INSTALL_HINT}"
        ) from exc
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
    include = lib_dir.parent / "include" if lib_dir is not None else None
    if include is not None and not (include / "cuda_runtime.h").is_file():
        include = None
    return lib, include


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != _NVRTC_SUCCESS:
        message = lib.nvrtcGetErrorString(result).decode(errors="replace")
        raise RuntimeError(f"nvrtc: {what} failed: {message} ({result})")


def version() -> tuple[int, int] | None:
    """NVRTC's (major, minor) version, or None when no NVRTC can be loaded."""
    try:
        lib, _ = _library()
    except NVRTCNotFoundError:
        return None
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def supported_archs() -> list[str]:
    """The ``sm_XX`` targets this NVRTC can compile for, e.g. ``["sm_75", ..., "sm_120"]``."""
    lib, _ = _library()
    count = ctypes.c_int()
    _check(lib, lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)), "nvrtcGetNumSupportedArchs")
    archs = (ctypes.c_int * count.value)()
    _check(lib, lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
    return [f"sm_{a}" for a in archs]


def _program_log(lib: ctypes.CDLL, prog: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    if lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) != _NVRTC_SUCCESS or size.value <= 1:
        return ""
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    return buf.value.decode(errors="replace")


def compile_source(src: str, name: str, arch: str = "sm_80", options: Sequence[str] = ()) -> bytes:
    """Compile CUDA C++ ``src`` to a CUBIN for ``arch`` (``"sm_80"``, ``"sm_90"``, …).

    ``name`` labels the source in diagnostics. ``options`` are extra NVRTC flags,
    appended after ``--gpu-architecture=<arch> -std=c++17`` and an ``-I`` for the
    CUDA headers that come with the library, when present.

    Raises:
        NVRTCNotFoundError: no NVRTC library can be loaded.
        CompileError: NVRTC rejected the source or the architecture; carries the full log.
    """
    if not (arch.startswith("sm_") and arch[3:].rstrip("af").isdigit()):
        raise ValueError(f"arch must look like 'sm_80' or 'sm_90a'; got {arch!r}")
    lib, include = _library()
    flags = [f"--gpu-architecture={arch}", "-std=c++17"]
    if include is not None:
        flags.append(f"-I{include}")
    flags.extend(options)

    prog = ctypes.c_void_p()
    _check(
        lib,
        lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        argv = (ctypes.c_char_p * len(flags))(*(f.encode() for f in flags))
        result = lib.nvrtcCompileProgram(prog, len(flags), argv)
        log = _program_log(lib, prog)
        if result != _NVRTC_SUCCESS:
            detail = lib.nvrtcGetErrorString(result).decode(errors="replace")
            if result != _NVRTC_ERROR_COMPILATION:
                # Usually a bad flag or an architecture this NVRTC does not know.
                detail += f"; flags: {' '.join(flags)}; targets: {', '.join(supported_archs())}"
            raise CompileError(name, arch, log, detail)
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_file(
    path: str | os.PathLike[str], arch: str = "sm_80", options: Sequence[str] = ()
) -> bytes:
    """Compile the ``.cu`` file at ``path`` to a CUBIN for ``arch``; see :func:`compile_source`."""
    path = Path(path)
    return compile_source(path.read_text(encoding="utf-8"), path.name, arch, options)

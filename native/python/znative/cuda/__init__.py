"""The one loader of zstack's CUDA kernels.

The ``.cu`` sources ship as package data in ``znative/cuda/kernels``. At run
time :func:`load_module` compiles one with NVRTC through CuPy's ``RawModule``
for the current device's architecture (once per process and architecture; CuPy
also keeps the binary in its on-disk cache), and :func:`launch` runs a kernel
on a CUDA stream the caller owns, given as a raw handle, so the work is ordered
with the caller's framework (for torch: ``torch.cuda.current_stream().cuda_stream``).
Device arrays cross by DLPack, never copied.

CuPy is an optional extra (``pip install znative[cuda12]`` or ``znative[cuda13]``)
and is imported on first use, never when this module is imported. Without a GPU,
:mod:`znative.cuda.nvrtc` still compiles every source; CI uses it to check them.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import cupy

__all__ = [
    "CudaUnavailableError",
    "as_cupy",
    "cupy_status",
    "f32",
    "i32",
    "i64",
    "kernel_dir",
    "kernel_sources",
    "launch",
    "load_module",
]

#: Sized scalar kernel arguments. A plain Python int/float would reach the kernel as
#: int64/double whatever its parameter type, so `launch` requires one of these.
f32 = np.float32
i32 = np.int32
i64 = np.int64

_INSTALL = "`pip install znative[cuda12]` (or [cuda13])"
# Flags every module is compiled with; CuPy adds the architecture itself.
_BASE_OPTIONS = ("-std=c++17",)

_modules: dict[tuple[str, str, tuple[str, ...]], cupy.RawModule] = {}
_kernels: dict[tuple[str, str, tuple[str, ...], str], cupy.RawKernel] = {}
_lock = threading.Lock()


class CudaUnavailableError(RuntimeError):
    """CuPy or a CUDA device is missing; the message names the fix."""


def kernel_dir() -> Path:
    """The directory that holds the packaged ``.cu`` sources."""
    return Path(__file__).resolve().parent / "kernels"


def kernel_sources() -> list[Path]:
    """Every packaged ``.cu`` source, sorted by name."""
    return sorted(kernel_dir().glob("*.cu"))


def cupy_status() -> tuple[bool, str]:
    """Whether CuPy can be used: ``(True, "cupy 13.3.0")`` or ``(False, <what to do>)``.

    Never raises. Imports CuPy (once) to find out, since an installed CuPy can
    still fail to load its CUDA libraries.
    """
    try:
        if importlib.util.find_spec("cupy") is None:
            return False, f"cupy is not installed; {_INSTALL}"
        import cupy
    except Exception as exc:  # a broken install raises anything from ImportError to OSError
        return False, (
            f"cupy is installed but failed to import ({type(exc).__name__}: {exc}); "
            f"reinstall the build matching your CUDA: {_INSTALL}"
        )
    return True, f"cupy {cupy.__version__}"


def _cupy() -> Any:
    cp = sys.modules.get("cupy")
    if cp is not None:  # imported already: skip the file-system probe on the launch path
        return cp
    ok, reason = cupy_status()
    if not ok:
        raise CudaUnavailableError(reason)
    import cupy

    return cupy


_device_seen = False


def _require_device(cp: Any) -> None:
    global _device_seen
    if _device_seen:
        return
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError as exc:
        count, reason = 0, str(exc)
    else:
        reason = "no device found"
    if count == 0:
        raise CudaUnavailableError(
            f"no usable CUDA device ({reason}); check `nvidia-smi` and CUDA_VISIBLE_DEVICES"
        )
    _device_seen = True


def _current_arch(cp: Any) -> str:
    _require_device(cp)
    return f"sm_{cp.cuda.Device().compute_capability}"


def load_module(name: str, *, options: Sequence[str] = ()) -> cupy.RawModule:
    """Compile ``kernels/{name}.cu`` for the current CuPy device and return the module.

    Modules are cached per ``(name, architecture, options)``; CuPy loads one
    into each device's context on first use there.

    Raises:
        CudaUnavailableError: CuPy is missing or broken, or no CUDA device is visible.
        FileNotFoundError: there is no such kernel source (the message lists them).
        znative.cuda.nvrtc.CompileError: NVRTC rejected the source; carries the log.
    """
    if not name or Path(name).name != name or name.endswith(".cu"):
        raise ValueError(
            f"kernel module name must be a bare file stem such as 'fused_adam'; got {name!r}"
        )
    cp = _cupy()
    arch = _current_arch(cp)
    key = (name, arch, tuple(options))
    module = _modules.get(key)
    if module is not None:
        return module
    path = kernel_dir() / f"{name}.cu"
    if not path.is_file():
        known = ", ".join(p.stem for p in kernel_sources()) or "none"
        raise FileNotFoundError(f"no CUDA kernel source {path}; packaged modules: {known}")
    with _lock:
        module = _modules.get(key)
        if module is None:
            module = cp.RawModule(
                code=path.read_text(encoding="utf-8"),
                options=(*_BASE_OPTIONS, *options),
                backend="nvrtc",
            )
            try:
                # Compile now, so a bad source fails here rather than at first launch.
                module.compile()
            except cp.cuda.compiler.CompileException as exc:
                from znative.cuda.nvrtc import CompileError

                raise CompileError(path.name, arch, str(exc)) from exc
            _modules[key] = module
    return module


def as_cupy(obj: Any) -> cupy.ndarray:
    """View a DLPack-capable device array (a CUDA torch tensor, …) as a CuPy array, no copy.

    Call it inside the stream context the array will be used on (as :func:`launch`
    does): the producer then orders its pending writes before that stream. CuPy
    has no bfloat16: pass such tensors as their 16-bit patterns
    (``t.view(torch.int16)``).
    """
    cp = _cupy()
    if isinstance(obj, cp.ndarray):
        return obj
    return cp.from_dlpack(obj)


def _kernel_arg(cp: Any, i: int, arg: Any) -> Any:
    if isinstance(arg, (cp.ndarray, np.generic)):
        return arg
    if isinstance(arg, (bool, int, float)):
        # CuPy would pass a Python int as int64 and a float as double: a silent
        # mismatch with an `int`/`float` parameter, so the width must be explicit.
        raise TypeError(
            f"args[{i}] is a Python {type(arg).__name__}; pass a sized scalar such as "
            "numpy.int32/int64/float32 matching the kernel's parameter"
        )
    if isinstance(arg, np.ndarray) or not hasattr(arg, "__dlpack__"):
        raise TypeError(
            f"args[{i}] ({type(arg).__name__}) is not a device array; pass a CUDA tensor, "
            "a cupy.ndarray or a numpy scalar"
        )
    return as_cupy(arg)


def _get_kernel(cp: Any, module_name: str, kernel_name: str, options: tuple[str, ...]) -> Any:
    # RawModule.get_function builds a new RawKernel each call; keep one per kernel.
    key = (module_name, _current_arch(cp), options, kernel_name)
    kernel = _kernels.get(key)
    if kernel is None:
        module = load_module(module_name, options=options)
        try:
            kernel = module.get_function(kernel_name)
        except cp.cuda.driver.CUDADriverError as exc:
            raise LookupError(f"{module_name}.cu has no kernel {kernel_name!r} ({exc})") from exc
        _kernels[key] = kernel
    return kernel


def launch(
    module_name: str,
    kernel_name: str,
    grid: int | tuple[int, ...],
    block: int | tuple[int, ...],
    args: Sequence[Any],
    *,
    stream: int,
    device: int | None = None,
    shared_mem: int = 0,
    options: Sequence[str] = (),
) -> None:
    """Launch ``kernel_name`` from ``kernels/{module_name}.cu`` on the CUDA stream ``stream``.

    Args:
        grid, block: launch shape, an int or a tuple of up to three ints.
        args: the kernel's arguments in order: DLPack-capable device arrays
            (passed as pointers) or sized numpy scalars (``numpy.float32(0.9)``).
        stream: a raw ``cudaStream_t`` handle owned by the caller (0 is the legacy
            default stream); it must stay alive until the kernel has run.
        device: CUDA device index the stream and arrays belong to; default: CuPy's
            current device.
        shared_mem: dynamic shared memory per block, in bytes.
        options: extra NVRTC flags for :func:`load_module`.

    The launch is asynchronous, like any kernel launch: the caller keeps the
    arrays alive until ``stream`` has passed it (stream-ordered allocators such
    as torch's caching allocator do so when the arrays were made on ``stream``).

    Raises:
        CudaUnavailableError, FileNotFoundError, CompileError: see :func:`load_module`.
        LookupError: the module has no kernel ``kernel_name``.
        TypeError: an argument is neither a device array nor a sized scalar.
    """
    cp = _cupy()
    _require_device(cp)
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    block = (block,) if isinstance(block, int) else tuple(block)
    with cp.cuda.Device(device):  # None: the current device
        kernel = _get_kernel(cp, module_name, kernel_name, tuple(options))
        # Arrays are exported inside the stream context so DLPack orders the
        # producer's pending work before `stream` (no-op when it is the same stream).
        with _external_stream(cp, stream):
            kernel_args = tuple(_kernel_arg(cp, i, a) for i, a in enumerate(args))
            kernel(grid, block, kernel_args, shared_mem=shared_mem)


def _external_stream(cp: Any, stream: int) -> Any:
    """CuPy's handle on the caller's raw ``cudaStream_t``. CuPy 14 deprecates
    ``ExternalStream`` (its warning, under pytest's ``filterwarnings = error``, failed every
    GPU test that launched a kernel on the H100); only that one notice is silenced, here,
    until CuPy's replacement takes a raw handle on every version we support."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="ExternalStream is deprecated", category=DeprecationWarning
        )
        return cp.cuda.ExternalStream(stream, cp.cuda.runtime.getDevice())

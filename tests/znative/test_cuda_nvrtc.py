"""The CUDA path without a GPU: every packaged ``.cu`` compiles with NVRTC for the
architectures we ship for, the sources are package data, and the loader fails
with a message that names the fix. The compile checks fail, never skip, without
NVRTC: CI has no GPU, so this is where a kernel that does not compile gets caught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import znative
import znative.cuda
from znative.cuda import nvrtc

ARCHS = ("sm_80", "sm_90")
ELF_MAGIC = b"\x7fELF"
SOURCE_KERNELS = Path(__file__).resolve().parents[2] / "native/python/znative/cuda/kernels"


@pytest.fixture(scope="module")
def nvrtc_lib() -> str:
    """The NVRTC library in use; fails (never skips) when there is none."""
    path = nvrtc.find_nvrtc()
    if path is None or nvrtc.version() is None:
        pytest.fail(
            f"NVRTC is required to compile-check the CUDA kernels (found: {path}); "
            f"{nvrtc.INSTALL_HINT}",
            pytrace=False,
        )
    return path


def test_kernel_sources_are_packaged() -> None:
    installed = Path(znative.__file__).resolve().parent / "cuda" / "kernels"
    assert znative.cuda.kernel_dir() == installed
    sources = znative.cuda.kernel_sources()
    assert sources, f"no .cu files in {installed}"
    assert all(p.parent == installed and p.suffix == ".cu" for p in sources)
    assert (installed / "fused_adam.cu") in sources


@pytest.mark.skipif(not SOURCE_KERNELS.is_dir(), reason="not run from a source checkout")
def test_installed_kernels_match_the_source_tree() -> None:
    """A .cu added or edited without rebuilding the wheel would be compile-checked stale."""
    installed = {p.name: p.read_bytes() for p in znative.cuda.kernel_sources()}
    source = {p.name: p.read_bytes() for p in sorted(SOURCE_KERNELS.glob("*.cu"))}
    assert sorted(installed) == sorted(source), "wheel lacks kernels; run `make setup`"
    stale = [name for name in source if installed[name] != source[name]]
    assert not stale, f"installed copies of {stale} are stale; run `make setup`"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", znative.cuda.kernel_sources(), ids=lambda p: p.name)
def test_kernel_compiles_to_cubin(nvrtc_lib: str, source: Path, arch: str) -> None:
    cubin = nvrtc.compile_file(source, arch)
    assert len(cubin) > 1024, f"{source.name} for {arch}: {len(cubin)}-byte CUBIN"
    assert cubin[:4] == ELF_MAGIC


def test_fused_adam_exports_its_kernels(nvrtc_lib: str) -> None:
    # extern "C" names are what zcore launches; a C++-mangled name would not be found.
    cubin = nvrtc.compile_file(znative.cuda.kernel_dir() / "fused_adam.cu", "sm_80")
    for name in (b"fused_adam_f32", b"fused_adam_bf16_grad"):
        assert name + b"\x00" in cubin


def test_broken_source_raises_compile_error_with_log(nvrtc_lib: str) -> None:
    src = 'extern "C" __global__ void k(float* x) { x[0] = undefined_name; }\n'
    with pytest.raises(nvrtc.CompileError) as info:
        nvrtc.compile_source(src, "broken.cu", "sm_90")
    err = info.value
    assert isinstance(err, RuntimeError)
    assert (err.name, err.arch) == ("broken.cu", "sm_90")
    assert "undefined_name" in err.log and "undefined_name" in str(err)
    assert "broken.cu(1)" in str(err)  # file and line, as NVRTC reports them


def test_unknown_arch_lists_the_supported_ones(nvrtc_lib: str) -> None:
    with pytest.raises(nvrtc.CompileError, match=r"targets: .*sm_80"):
        nvrtc.compile_source('extern "C" __global__ void k() {}', "ok.cu", "sm_10")
    with pytest.raises(ValueError, match="sm_80"):
        nvrtc.compile_source('extern "C" __global__ void k() {}', "ok.cu", "80")
    assert {"sm_80", "sm_90"} <= set(nvrtc.supported_archs())


def test_nvrtc_version_and_env_override(nvrtc_lib: str, monkeypatch: pytest.MonkeyPatch) -> None:
    major, _ = nvrtc.version()
    assert major >= 12
    monkeypatch.setenv("ZNATIVE_NVRTC", "/opt/custom/libnvrtc.so.13")
    assert nvrtc.find_nvrtc() == "/opt/custom/libnvrtc.so.13"
    monkeypatch.delenv("ZNATIVE_NVRTC")
    assert nvrtc.find_nvrtc() == nvrtc_lib


def test_importing_znative_cuda_loads_neither_cupy_nor_torch() -> None:
    code = (
        "import sys, znative, znative.cuda, znative.cuda.nvrtc\n"
        "print(sorted({'cupy', 'torch'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cupy_status_is_actionable() -> None:
    ok, message = znative.cuda.cupy_status()
    assert isinstance(ok, bool)
    if ok:
        assert message.startswith("cupy ")
    else:
        assert "pip install znative[cuda12]" in message


def test_loader_without_cuda_names_the_fix() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the GPU tests exercise the loader")
    fix = r"znative\[cuda12\]|nvidia-smi"  # no CuPy, or CuPy but no device
    with pytest.raises(znative.cuda.CudaUnavailableError, match=fix) as info:
        znative.cuda.load_module("fused_adam")
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(znative.cuda.CudaUnavailableError):
        znative.cuda.launch("fused_adam", "fused_adam_f32", 1, 32, (), stream=0)

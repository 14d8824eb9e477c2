"""The SIMD paths of `z bench serve --compare llama.cpp`: which one each side ran, and
``--simd avx2`` to force the AVX2 case on any x86 host.

A helper module of ``benchmarks/_serve_compare.py``. Forcing a level takes effect only in a
fresh process (torch fixes its CPU capability, oneDNN and MKL their ISA, at their first
kernel), so :func:`run_forced` runs the comparison in a child ``python`` with:

* ``ZNATIVE_SIMD`` (znative's runtime dispatch, checked at import);
* ``ATEN_CPU_CAPABILITY`` (torch's own vectorized kernels), ``ONEDNN_MAX_CPU_ISA`` and
  ``MKL_ENABLE_INSTRUCTIONS`` (the GEMM libraries torch calls, which pick their ISA apart
  from ATen: without them an AVX-512/AMX host's bf16 and fp32 matmuls ran AVX-512);
* llama-cpp-python from ``make llama-cpp-avx2``'s directory (AVX2, FMA, F16C; no AVX-512,
  VNNI or AMX) first on ``PYTHONPATH``; a peer whose ``llama_print_system_info`` still
  reports AVX-512 is not run.

:func:`record` is what the JSON's ``simd`` holds: the level asked for, znative's active and
detected levels, torch's ``get_cpu_capability()`` and those environment variables, and the
peer's system info line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: ``--simd`` values -> the environment of the process that runs the comparison.
LEVELS: dict[str, dict[str, str]] = {
    "avx2": {
        "ZNATIVE_SIMD": "avx2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
}
ENV_KEYS = ("ZNATIVE_SIMD", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
#: Set in the child so it runs the comparison itself instead of starting another.
CHILD_MARK = "ZSTACK_SERVE_SIMD"
LLAMACPP_AVX2_DIR = Path.home() / ".cache" / "zstack" / "llama-cpp-avx2"


def check(simd: str | None) -> None:
    """A ``--simd`` value we cannot honour is an error naming the ones we can."""
    if simd is not None and simd not in LEVELS:
        raise ValueError(f"--simd {simd!r}: the forceable levels are {', '.join(LEVELS)}")


def needs_child(simd: str | None) -> bool:
    """Whether this process must hand the run to a child started with ``simd``'s environment."""
    return simd is not None and os.environ.get(CHILD_MARK) != simd


def peer_dir(simd: str) -> Path:
    """Where ``make llama-cpp-avx2`` put the AVX2-only llama-cpp-python."""
    return Path(os.environ.get("LLAMACPP_AVX2_DIR", LLAMACPP_AVX2_DIR))


def run_forced(simd: str, model_dir: Path, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``run_compare(model_dir, **kwargs)`` in a child process forced to ``simd``."""
    env = {**os.environ, **LEVELS[simd], CHILD_MARK: simd}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(peer_dir(simd))] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    here = Path(__file__).parent
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        code = (
            "import json, sys; from pathlib import Path; from zcore.bench import load; "
            f"m = load('_serve_compare', Path({str(here)!r})); "
            f"kw = json.loads({json.dumps(kwargs)!r}); "
            f"r = m.run_compare(Path({str(model_dir)!r}), simd={simd!r}, **kw); "
            f"Path({str(out)!r}).write_text(json.dumps(r))"
        )
        proc = subprocess.run([sys.executable, "-c", code], env=env, check=False)
        if proc.returncode != 0:
            raise RuntimeError(
                f"the --simd {simd} comparison's process exited with {proc.returncode}"
                " (its output is above)"
            )
        return dict(json.loads(out.read_text()))


def install_hint(simd: str) -> str:
    """How to get the peer this level runs."""
    return (
        f"--simd {simd}: llama-cpp-python is not importable from {peer_dir(simd)}; run "
        "`make llama-cpp-avx2` (builds it for AVX2 only there), then rerun"
    )


def peer_info() -> dict[str, Any]:
    """llama.cpp's ``llama_print_system_info`` line and where it was loaded from."""
    try:
        import llama_cpp
    except (ImportError, OSError) as exc:
        return {"system_info": None, "error": str(exc)}
    info = llama_cpp.llama_print_system_info()
    return {
        "system_info": info.decode() if isinstance(info, bytes) else str(info),
        "path": str(Path(llama_cpp.__file__).parent),
    }


def peer_refusal(simd: str | None, info: dict[str, Any]) -> str | None:
    """Why the peer must not run at ``simd`` (its build has wider SIMD), or None."""
    line = info.get("system_info") or ""
    if simd == "avx2" and any(f"{f} = 1" in line for f in ("AVX512", "AVX512_VNNI", "AMX_INT8")):
        return (
            f"--simd avx2, but llama.cpp from {info.get('path')} runs AVX-512/AMX ({line.strip()});"
            f" build the AVX2-only one with `make llama-cpp-avx2` (into {peer_dir(simd)})"
        )
    return None


def record(simd: str | None, peer: dict[str, Any] | None) -> dict[str, Any]:
    """Both sides' SIMD paths for the JSON."""
    import torch

    out: dict[str, Any] = {"requested": simd or "native"}
    try:
        import znative

        out["znative"] = str(znative.simd_level())
        out["znative_detected"] = str(znative.detected_simd_level())
        out["znative_int8_vnni"] = bool(znative.int8_vnni_available())
    except ImportError:
        out["znative"] = None
    out["torch"] = str(torch.backends.cpu.get_cpu_capability())
    out["env"] = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    if peer is not None:
        out["llama.cpp"] = peer.get("system_info")
    return out

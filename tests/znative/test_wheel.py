"""The built znative wheel installs and works in a fresh virtual environment
with no Rust toolchain on PATH: nothing is compiled on a user's machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import numpy as np, znative, znative.cuda
p = np.ones(40000, np.float32); g = np.full(40000, 0.5, np.float32)
m = np.zeros(40000, np.float32); v = np.zeros(40000, np.float32)
znative.adam_step(p, g, m, v, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
assert abs(float(p[0]) - 0.9) < 1e-5, p[0]
assert znative.cuda.kernel_sources(), "no .cu sources shipped in the wheel"
print(znative.__version__, znative.simd_level())
"""


def test_wheel_installs_and_imports_without_rust(tmp_path):
    wheels = sorted((ROOT / "dist" / "znative").glob("znative-*.whl"))
    assert wheels, "no znative wheel in dist/znative; run `make setup` first"
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    assert uv, "uv is not installed in this environment; run `make setup`"
    venv = tmp_path / "fresh"
    subprocess.run([uv, "venv", "-q", "-p", sys.executable, str(venv)], check=True, timeout=120)
    # PATH without cargo/rustc: only the fresh venv and the system's basic tools.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CARGO_HOME")}
    env["PATH"] = f"{venv / 'bin'}:/usr/bin:/bin"
    assert shutil.which("cargo", path=env["PATH"]) is None, "cargo is still reachable on PATH"
    py = str(venv / "bin" / "python")
    subprocess.run(
        [uv, "pip", "install", "-q", "--python", py, str(wheels[-1])],
        check=True,
        env=env,
        timeout=300,
    )
    out = subprocess.run(
        [py, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    version, simd = out.stdout.split()
    assert version == "0.1.0" and simd in ("avx512", "avx2", "scalar")

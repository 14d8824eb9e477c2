"""`z train --cp N`: bad input exits 2 before any rank starts, naming the numbers and the
fix (in this process); a tiny cp=2 launcher run trains, exports a GPT and `z generate`
reads it (slow).

The equivalence of the sequence-parallel GPT with one process is
tests/ztrain/test_train_cp.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zstack.cli import app
from ztrain.metrics import read_jsonl

Z = Path(sys.executable).parent / "z"


@pytest.mark.parametrize(
    ("args", "wanted"),
    [
        (["--nproc", "2", "--cp", "3"], "`--cp 3` does not divide `--nproc 2`"),
        (["--nproc", "4", "--cp", "3"], "pass `--nproc 3`, or a `--cp` that divides 4"),
        (["--nproc", "2", "--cp", "2", "--seq-len", "1"], "`--seq-len 1` is shorter than"),
        (["--nproc", "4", "--cp", "2", "--pp", "2"], "`--cp` with `--pp` is not built"),
        (["--nproc", "2", "--cp", "2", "--moe"], "`--cp` with `--moe` is not built"),
    ],
)
def test_bad_cp_exits_2_naming_the_fix(args: list[str], wanted: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "run"), *args])
    assert result.exit_code == 2, result.output
    assert wanted in " ".join(result.output.split()), result.output


@pytest.mark.slow(reason="a 2-rank launcher run: 40 s under load, 3 min building the tokenizer")
def test_cp2_run_trains_exports_and_generates(tmp_path: Path) -> None:
    out = tmp_path / "cp2"
    args = ["--nproc", "2", "--cp", "2", "--preset", "tiny", "--steps", "3", "--seq-len", "33"]
    args += ["--micro-batch", "2", "--eval-every", "3", "--out", str(out)]
    done = subprocess.run(
        [str(Z), "train", *args], capture_output=True, text=True, timeout=300, env=os.environ
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(pp 1 x tp 1 x dp 1 x cp 2)" in done.stdout, done.stdout
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    gen = subprocess.run(
        [str(Z), "generate", "--checkpoint", str(out), "--prompt", "ROMEO:"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ,
    )
    assert gen.returncode == 0 and gen.stdout.startswith("ROMEO:"), gen.stdout + gen.stderr

"""`z train --pp P --tp T`: bad layouts fail before any rank starts, naming the numbers and
the fix; a tiny pipelined (and tensor-parallel) run trains, checkpoints and exports a GPT
that loads as the plain one does.

The bad-layout cases run in this process (no ranks); the runs are real launcher runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zstack.cli import app
from ztrain.generate import load_for_generation
from ztrain.metrics import read_jsonl

Z = Path(sys.executable).parent / "z"
TINY = ["--preset", "tiny", "--seq-len", "16", "--micro-batch", "2"]


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["train", *args])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("args", "wanted"),
    [
        (
            ["--nproc", "6", "--pp", "2", "--tp", "2"],
            "`--nproc 6` is not divisible by `--pp 2` x `--tp 2` = 4",
        ),
        (["--nproc", "3", "--tp", "3"], "preset tiny has n_head 4, not divisible by `--tp 3`"),
        (["--nproc", "2", "--tp", "2", "--vocab-size", "515"], "`--vocab-size 515` is not"),
        (["--nproc", "2", "--pp", "2", "--schedule", "zbv"], "zbv cannot run the validation"),
        (["--nproc", "2", "--pp", "2", "--schedule", "nope"], "`--schedule nope` is not one"),
        (["--nproc", "2", "--pp", "2", "--microbatches", "1"], "`--microbatches 1` < `--pp 2`"),
        (["--nproc", "8", "--pp", "8"], "has 4 transformer blocks but `--pp 8`"),
        (["--nproc", "2", "--schedule", "gpipe"], "are pipeline flags; add `--pp 2`"),
        (["--nproc", "2", "--pp", "2", "--moe"], "`--pp`/`--tp` with `--moe` is not built"),
    ],
)
def test_bad_layouts_exit_2_naming_the_fix(args: list[str], wanted: str, tmp_path: Path) -> None:
    preset = [] if "--preset" in args else ["--preset", "tiny"]
    code, text = invoke(*args, *preset, "--out", str(tmp_path / "run"))
    assert code == 2, text
    assert wanted in text, text
    assert not (tmp_path / "run").exists()


def z_train(out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    cmd = [str(Z), "train", *TINY, "--steps", "2", "--eval-every", "2", "--out", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ)


def _check_run(out: Path, done: subprocess.CompletedProcess[str], layout: str) -> None:
    assert done.returncode == 0, done.stdout + done.stderr
    assert layout in done.stdout, done.stdout
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[-1]["val_loss"] < records[0]["val_loss"] + 0.05
    model, _ = load_for_generation(out / "export")  # the plain GPT's names and shapes
    assert model.config.n_layer == 4
    tag = out / "checkpoints" / "global_step2"  # the sharded checkpoint, renamed on load
    result = CliRunner().invoke(
        app, ["generate", "--checkpoint", str(tag), "--prompt", "A", "--max-new-tokens", "2"]
    )
    assert result.exit_code == 0, result.output


@pytest.mark.slow(reason="a 2-rank launcher run, 45 s here under load")
def test_pp2_run_trains_and_exports_a_gpt(tmp_path: Path) -> None:
    out = tmp_path / "pp2"
    done = z_train(out, "--nproc", "2", "--pp", "2")
    _check_run(out, done, "(pp 2 x tp 1 x dp 1, 1f1b over 4 micro-batches)")


@pytest.mark.slow(reason="a 2-rank launcher run")
def test_tp2_run_trains_and_exports_a_gpt(tmp_path: Path) -> None:
    out = tmp_path / "tp2"
    done = z_train(out, "--nproc", "2", "--tp", "2", "--stage", "3")
    _check_run(out, done, "(pp 1 x tp 2 x dp 1)")


@pytest.mark.slow(reason="4 ranks through the launcher")
def test_pp2_tp2_run_trains_and_exports_a_gpt(tmp_path: Path) -> None:
    out = tmp_path / "pp2tp2"
    done = z_train(out, "--nproc", "4", "--pp", "2", "--tp", "2", "--schedule", "gpipe")
    _check_run(out, done, "(pp 2 x tp 2 x dp 1, gpipe over 4 micro-batches)")


@pytest.mark.slow(reason="8 ranks through the launcher")
def test_pp2_tp2_dp2_run(tmp_path: Path) -> None:
    out = tmp_path / "pp2tp2dp2"
    done = z_train(out, "--nproc", "8", "--pp", "2", "--tp", "2", "--microbatches", "2")
    _check_run(out, done, "(pp 2 x tp 2 x dp 2, 1f1b over 2 micro-batches)")


@pytest.mark.slow(reason="a 4-rank launcher run, then one rank")
def test_pp2_tp2_checkpoint_resumes_on_one_plain_rank(tmp_path: Path) -> None:
    """The checkpoint keys parameters by the plain GPT's names, so one rank without
    pipeline or tensor parallelism continues it (re-cut on load)."""
    out = tmp_path / "pp2tp2"
    done = z_train(out, "--nproc", "4", "--pp", "2", "--tp", "2", "--microbatches", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    code, text = invoke(
        *TINY, "--nproc", "1", "--resume", "--steps", "3", "--grad-accum", "2", "--out", str(out)
    )
    assert code == 0, text
    assert "steps 2 -> 3" in text
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]

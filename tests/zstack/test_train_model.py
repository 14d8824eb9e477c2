"""`z train --model HF_DIR`: a Hugging Face causal LM trains on `z train`'s Shakespeare through
`z finetune` (zcore.hf.Trainer): the plays become JSONL in OUT/data, the options that mean the
same pass on, and the ones that shape z train's own GPT are refused by name."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from tests.utils.tiny_lm import write_tiny_lm
from zstack.cli import app

Z = Path(sys.executable).parent / "z"


@pytest.mark.parametrize(
    ("args", "wanted"),
    [
        (["--preset", "tiny", "--pp", "2"], "--preset, --pp shape `z train`'s own GPT"),
        (["--moe"], "--moe shape `z train`'s own GPT"),
        (["--config", "ds.json", "--stage", "2"], "`--config` with `--stage`/`--bf16`"),
    ],
)
def test_options_for_the_gpt_are_refused_by_name(args: list[str], wanted: str) -> None:
    result = CliRunner().invoke(app, ["train", "--model", "llama-dir", *args])
    assert result.exit_code == 2, result.output
    assert wanted in result.output, result.output


def _run(tmp_path: Path, *args: str) -> tuple[Path, str]:
    import subprocess

    model = write_tiny_lm(tmp_path / "tiny")
    out = tmp_path / "run"
    cmd = [str(Z), "train", "--model", str(model), "--out", str(out), "--seq-len", "32"]
    cmd += ["--steps", "2", "--micro-batch", "2", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return out, done.stdout


@pytest.mark.slow(reason="z finetune tokenizes every play: ~2 min here under load")
def test_a_llama_trains_on_the_plays_through_finetune(tmp_path: Path) -> None:
    out, stdout = _run(tmp_path, "--nproc", "1", "--stage", "3", "--eval-every", "1")
    assert "z train --model: z finetune" in stdout and "--eval-data" in stdout, stdout
    assert json.loads((out / "data" / "ds_config.json").read_text()) == {
        "zero_optimization": {"stage": 3}
    }
    examples = (out / "data" / "shakespeare.jsonl").read_text().splitlines()
    held = (out / "data" / "shakespeare-val.jsonl").read_text().splitlines()
    assert len(examples) > 10_000 and len(held) == 256
    assert "done: 2 steps" in stdout, stdout
    with safe_open(str(out / "final" / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 64]


@pytest.mark.slow(reason="a 2-rank launcher run importing transformers (~60-140 s here)")
def test_a_llama_trains_at_tp2(tmp_path: Path) -> None:
    out, stdout = _run(tmp_path, "--nproc", "2", "--tp", "2")
    assert "2 rank(s) (tp 2 x dp 1)" in stdout and "done: 2 steps" in stdout, stdout
    with safe_open(str(out / "final" / "model.safetensors"), "pt") as f:  # gathered whole
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [64, 64]

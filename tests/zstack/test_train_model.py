"""`z train --model HF_DIR`: `z train` trains its own GPT; a Hugging Face model (at any `--tp`)
trains through `z finetune`, the Trainer path a DeepSpeed AutoTP user knows, and the error
says the command to run, with the numbers given."""

from __future__ import annotations

from typer.testing import CliRunner

from zstack.cli import app


def test_train_model_names_the_finetune_command() -> None:
    result = CliRunner().invoke(app, ["train", "--model", "llama-dir", "--tp", "2", "--nproc", "4"])
    assert result.exit_code == 2
    assert "z finetune llama-dir DATA.jsonl --tp 2 --nproc 4" in result.output, result.output

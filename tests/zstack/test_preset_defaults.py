"""A preset's defaults run as given (issue 43, item 7), for each command with `--preset`.

`z train`'s option defaults are `TrainOptions`' defaults, so what `tests/ztrain/
test_train_plan.py` plans for every preset (`TrainOptions(preset=P)` on 2 ranks) is what
`z train --preset P` runs. `z bench zero-step`'s `--seq` defaults to the preset's (at most 256)
and a longer one is refused before any rank starts. (`z bench zero`, `comm` and `efficiency`
use 64 tokens, which every preset holds; `z bench offload` cuts its `--seq` to the preset's.)"""

from __future__ import annotations

import dataclasses

import pytest
import typer.main

from zstack.bench import load
from zstack.cli import app
from ztrain.train_options import TrainOptions


def test_z_train_defaults_are_the_train_options_defaults() -> None:
    command = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
    flags = {p.name: p.default for p in command.params}
    assert flags.pop("nproc") == 2  # the world size the plan test uses
    assert flags.pop("model") is None  # a Hugging Face model goes to z finetune (train_hf.py)
    fields = {f.name: f.default for f in dataclasses.fields(TrainOptions) if f.name != "explicit"}
    assert flags == fields


def test_bench_zero_step_refuses_a_seq_the_preset_cannot_hold() -> None:
    zero_step = load("zero_step")
    with pytest.raises(ValueError, match=r"--seq 256 exceeds preset tiny's block_size 128"):
        zero_step.run(preset="tiny", seq=256)
    with pytest.raises(ValueError, match=r"--preset 'huge': choose one of \["):
        zero_step.run(preset="huge")

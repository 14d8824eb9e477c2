"""A preset's defaults run as given: every preset, as the GPT, the MoE LM (`--moe`) and its
dense twin, plans with no option but the preset (issue 43, item 7: `z train --preset tiny`
failed on its own default `--seq-len 256`, above tiny's block_size 128); a `--seq-len` the
preset cannot hold is refused naming its limit. Planning builds no model and trains nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from ztrain.gpt import DEFAULT_SEQ_LEN, PRESETS, default_seq_len
from ztrain.moe_plan import model_config
from ztrain.train_options import TrainError, TrainOptions
from ztrain.train_plan import plan_run

WORLD = 2  # `z train`'s default `--nproc`
MODELS = {"gpt": {}, "moe": {"moe": True}, "dense_twin": {"dense_twin": True}}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_plans_with_its_defaults(tmp_path: Path, preset: str, model: str) -> None:
    plan = plan_run(TrainOptions(out=tmp_path / "run", preset=preset, **MODELS[model]), WORLD)
    block = PRESETS[preset]["block_size"]
    assert plan.seq_len == min(DEFAULT_SEQ_LEN, block) == default_seq_len(preset)
    config = model_config(preset, plan.vocab_size, plan.moe)
    assert plan.seq_len <= config.block_size == block
    assert (plan.moe is None) == (model == "gpt")


def test_a_given_seq_len_wins_and_one_too_long_names_the_limit(tmp_path: Path) -> None:
    plan = plan_run(TrainOptions(out=tmp_path / "a", preset="medium", seq_len=512), WORLD)
    assert plan.seq_len == 512  # medium's block_size is 1024: above the 256 default
    message = r"`--seq-len 256` exceeds preset tiny's block_size 128; pass `--seq-len 128` or less"
    with pytest.raises(TrainError, match=message + r" \(or leave it out: 128\)"):
        plan_run(TrainOptions(out=tmp_path / "b", preset="tiny", seq_len=256), WORLD)


def test_default_seq_len_names_an_unknown_preset() -> None:
    with pytest.raises(ValueError, match=r"unknown GPT preset 'huge'; choose one of \["):
        default_seq_len("huge")

"""A DeepSpeed user's Trainer fine-tuning script moved to zcore by one line (the Trainer class),
started by a launcher on every rank (test_trainer_launch.py): ``SCRIPT MODEL_DIR OUT
DS_CONFIG.json``. Rank 0 writes each logged step's loss to ``OUT/losses.json``; every rank
saves the model to ``OUT/final``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, for `tests.`

import torch
from transformers import LlamaForCausalLM

import zcore.hf
from tests.zcore.hf import trainer_common as tc


def main(model_dir: str, out: str, ds_config: str) -> None:
    args = tc.training_args(Path(out), tc.MB, num_train_epochs=1)
    stage = json.loads(Path(ds_config).read_text())["zero_optimization"]["stage"]
    torch.manual_seed(0)
    if stage == 3:
        init = zcore.hf.init_config(ds_config, args, hidden_size=64)
        model = zcore.hf.from_pretrained(LlamaForCausalLM, model_dir, ds_config=init)
    else:
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = zcore.hf.Trainer(
        model=model, args=args, train_dataset=tc.dataset(3 * 8), config=ds_config
    )
    trainer.train()
    trainer.save_model(f"{out}/final")
    if trainer.is_world_process_zero():
        (Path(out) / "losses.json").write_text(json.dumps(tc.history(trainer)["loss"]))


if __name__ == "__main__":
    main(*sys.argv[1:4])

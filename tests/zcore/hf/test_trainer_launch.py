"""zcore.hf.Trainer started as a user starts it: a script (finetune_script.py) on 2 ranks
through ``torchrun`` or ``z launch``, the ZeRO config a JSON file, the process group left to
TrainingArguments, CPU optimizer offload at stage 2. Losses rel 1e-5 against the plain
single-process Trainer; the saved directory loads in transformers.

Slow: each launch starts fresh interpreters that import torch and transformers (~20 s); the
default tests in test_trainer.py run the same Trainer on ``run_ranks``' ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.utils.cli import run_z
from tests.utils.distributed import free_port
from tests.zcore.hf import trainer_common as tc

SCRIPT = Path(__file__).with_name("finetune_script.py")


@pytest.mark.slow(
    reason="fresh launcher ranks import transformers; test_trainer.py's default tests run the "
    "same Trainer on run_ranks"
)
@pytest.mark.parametrize(
    ("launcher", "stage", "offload"),
    [("torchrun", 3, False), ("z launch", 2, True)],
    ids=["torchrun-zero3", "z-launch-zero2-offload"],
)
def test_a_launched_script_trains_like_the_plain_trainer(
    tmp_path: Path, launcher: str, stage: int, offload: bool
) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = tc.write_model(tmp_path / "tiny")
    config = tc.zero_config(stage)
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    ds_config = tmp_path / "ds_config.json"
    ds_config.write_text(json.dumps(config))
    out = tmp_path / "out"
    script = [str(SCRIPT), str(model_dir), str(out), str(ds_config)]
    port = str(free_port())
    if launcher == "torchrun":
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--nproc-per-node", "2", "--master-port", port, *script]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    else:
        run_z("launch", "--nproc", "2", "--master-port", port, *script, timeout=600)
    losses = json.loads((out / "losses.json").read_text())
    plain = tc.plain_run(model_dir, tmp_path / "plain", 3 * 8, num_train_epochs=1)
    assert losses == pytest.approx(plain["history"]["loss"], rel=1e-5)
    saved = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([tc.PROBE])
        torch.testing.assert_close(
            saved(ids).logits, plain["model"].eval()(ids).logits, rtol=0, atol=1e-4
        )

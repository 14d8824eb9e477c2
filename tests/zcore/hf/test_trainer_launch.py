"""zcore.hf.Trainer started as a user starts it, and ended by a dead rank: a script (finetune_script.py) on 2 ranks
through ``torchrun``, ``z launch`` or ``accelerate launch`` (``--multi_gpu``: accelerate's
torchrun launcher, which on CPU starts gloo ranks), the ZeRO config a JSON file, the process group left to
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
from typing import Any

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
    [("torchrun", 3, False), ("z launch", 2, True), ("accelerate launch", 3, False)],
    ids=["torchrun-zero3", "z-launch-zero2-offload", "accelerate-launch-zero3"],
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
    elif launcher == "accelerate launch":  # its multi-process launcher is torchrun's
        accelerate = Path(sys.executable).with_name("accelerate")
        cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2"]
        cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        cmd += ["--main_process_port", port, *script]
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


def _dies_after_step_1(rank: int, world: int, model_dir: str, tmp: str) -> str:
    from transformers import TrainerCallback

    class Die(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if rank == 1 and state.global_step == 1:
                os._exit(3)  # a rank killed mid-run: no exception, no goodbye

    trainer = tc.zcore_trainer(world, model_dir, f"{tmp}/z", 3, 6 * 8, num_train_epochs=1)
    trainer.add_callback(Die())
    trainer.train()
    return "finished"


@pytest.mark.slow(
    reason="2 ranks that import transformers, one killed; a failure path no default test runs"
)
def test_a_dead_rank_ends_the_job_with_zcores_named_error(tmp_path: Path) -> None:
    from zcore import ranks

    model_dir = tc.write_model(tmp_path / "tiny")
    outcomes = ranks.run_ranks(
        _dies_after_step_1,
        2,
        (str(model_dir), str(tmp_path)),
        timeout_s=300,
        start_method="forkserver",
        grace_s=120,  # time for rank 0 to notice
        group_timeout_s=60,
    )
    assert outcomes[1].kind == "died" and outcomes[1].payload == 3
    assert outcomes[0].kind == "error"
    assert outcomes[0].exc_type == "zcore.comm.collectives.CollectiveError", outcomes[0].payload
    assert "rank 0/2" in outcomes[0].message and "step 1" in outcomes[0].message
    assert "may have died" in outcomes[0].message

"""Packages plug into zcore through entry points alone, end to end on 2 gloo ranks: a package
outside zcore (`zplug`, written at test time) registers an optimizer type and a config block and
trains with them; zquant's `compression_training` block starts `zcore.initialize` next to
`zero_optimization`."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.plugin_package import write_zplug
from tests.zcore.zero.common import config, full_params, global_batch, make_model, train
from zcore.config import ConfigError, ZConfig

STEPS = 4
LR = 0.05


def _expected() -> dict[str, torch.Tensor]:
    """What `p -= lr * grad` gives on one process: the same global batches, clipped at 0.5."""
    model = make_model()
    for step in range(STEPS):
        x, y = global_batch(step, 8)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
                p.grad = None
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_with_zplug(rank: int, world: int, plug_dir: str, stage: int) -> dict[str, Any]:
    sys.path.insert(0, plug_dir)  # as PYTHONPATH would: the rank's interpreter is already up
    cfg = config(
        stage,
        mb=4 // world,
        optimizer={"type": "plainsgd", "params": {"lr": LR}},
        zplug={"tag": "run-1", "warmup_steps": 2},
    )
    engine, *_ = zcore.initialize(make_model(), config=cfg)
    block = engine.config.extension("zplug")
    optimizer = engine.config.optimizer
    seen = {
        "block": (type(block).__module__, type(block).__name__, block.tag, block.warmup_steps),
        "type": optimizer.type,
        "inner": type(engine.optimizer).__name__,
        "reduces_own_gradients": optimizer.reduces_own_gradients,
    }
    losses = train(engine, STEPS)
    typos = []
    for bad in ({"zplug": {"tag": "x", "warmup_step": 1}}, {"optimizer": {"type": "PlainSDG"}}):
        with pytest.raises(ConfigError) as info:
            ZConfig.load(bad)
        typos.append(str(info.value))
    return {"seen": seen, "losses": losses, "params": full_params(engine), "typos": typos}


def test_plugin_optimizer_and_block_train_end_to_end(tmp_path: Path) -> None:
    plug_dir = str(write_zplug(tmp_path))
    expected = _expected()
    for got in run_ranks(_train_with_zplug, 2, args=(plug_dir, 3)):
        assert got["seen"] == {
            "block": ("zplug", "ZPlugBlock", "run-1", 2),
            "type": "PlainSGD",
            "inner": "PlainSGD",
            "reduces_own_gradients": False,
        }
        assert all(torch.isfinite(torch.tensor(got["losses"])))
        for name, value in expected.items():
            torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=0, msg=name)
        block_typo, type_typo = got["typos"]
        assert block_typo == "unknown key zplug.warmup_step; did you mean warmup_steps?"
        assert type_typo.startswith(
            'optimizer.type = "PlainSDG": not a registered optimizer type; did you mean PlainSGD?'
        )


def _initialize_with_compression(rank: int, world: int, ds_config: dict[str, Any]) -> Any:
    engine, *_ = zcore.initialize(make_model(), config=ds_config)
    losses = train(engine, 2)
    block = engine.config.extension("compression_training")
    return type(block).__module__, engine.stage, losses


def test_zero_and_compression_training_in_one_ds_config() -> None:
    from tests.zquant.test_compression import DS_CONFIG

    ds_config = {**copy.deepcopy(DS_CONFIG), **config(2, mb=2)}  # train_batch_size 8 = 2 x 2 x 2
    for module, stage, losses in run_ranks(_initialize_with_compression, 2, args=(ds_config,)):
        assert (module, stage) == ("zquant.compression.config", 2)
        assert all(torch.isfinite(torch.tensor(losses)))

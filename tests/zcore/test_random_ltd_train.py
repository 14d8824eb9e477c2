"""`z train --config` honours random-LTD: the recipe's config merge keeps the block, the
engine routes the GPT's middle layers from it, and a layer count unlike the preset's fails
at start naming the key (the z train run itself: slow)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from zcore.config import ConfigError


def _block(total: int, ids: list[int], seq: int) -> dict[str, Any]:
    return {
        "data_efficiency": {
            "enabled": True,
            "data_routing": {
                "enabled": True,
                "random_ltd": {
                    "enabled": True,
                    "total_layer_num": total,
                    "random_ltd_layer_num": len(ids),
                    "random_ltd_layer_id": ids,
                    "random_ltd_schedule": {
                        "min_value": seq // 4,
                        "max_value": seq,
                        "schedule_type": "fixed_linear",
                        "schedule_config": {"require_steps": 2, "seq_per_step": 8},
                    },
                },
            },
        }
    }


def _opts(tmp_path: Path, block: dict[str, Any], steps: int = 2) -> Any:
    from ztrain.train_options import TrainOptions

    path = tmp_path / "ltd.json"
    path.write_text(json.dumps(block))
    return TrainOptions(
        out=tmp_path / "run",
        preset="tiny",
        steps=steps,
        stage=2,
        config=path,
        micro_batch=2,
        seq_len=32,
        eval_every=steps,
    )


def test_the_recipe_config_keeps_the_block_and_the_engine_routes_the_gpt(tmp_path: Path) -> None:
    import zcore
    from ztrain.gpt import GPT, GPTConfig
    from ztrain.train_config import build_config

    rc = build_config(_opts(tmp_path, _block(4, [1, 2], 32)), world_size=1)
    assert rc.as_dict["data_efficiency"]["data_routing"]["random_ltd"]["random_ltd_layer_id"] == [
        1,
        2,
    ]
    model = GPT(GPTConfig.preset("tiny", vocab_size=300))
    engine, *_ = zcore.initialize(model, config=rc.as_dict)
    assert engine.random_ltd is not None and engine.random_ltd.layers is model.transformer.h
    routed = [i for i, b in enumerate(model.transformer.h) if "forward" in b.__dict__]
    assert routed == [1, 2]
    engine.destroy()


@pytest.mark.slow  # trains the tokenizer on a clean clone
def test_z_train_runs_with_random_ltd_and_refuses_a_wrong_layer_count(tmp_path: Path) -> None:
    from ztrain.metrics import read_jsonl
    from ztrain.train import run
    from ztrain.train_plan import plan_run

    opts = _opts(tmp_path, _block(4, [1, 2], 32))
    assert run(plan_run(opts, 1), echo=lambda line: None, report=False) == 0
    losses = [r["loss"] for r in read_jsonl(opts.out / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    (tmp_path / "bad").mkdir()
    bad = _opts(tmp_path / "bad", _block(6, [1, 2], 32))
    with pytest.raises(
        ConfigError, match=r"random_ltd\.total_layer_num = 6: the model has 4 layers"
    ):
        run(plan_run(bad, 1), echo=lambda line: None, report=False)

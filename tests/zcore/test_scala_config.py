"""The `scala` block: its keys and values checked at start, naming the key and the fix, both
through `ZConfig.load` (the registered block) and `ScaLA(engine, config)`; the embedding found
by name or `get_input_embeddings()`; ZeRO stage 3 refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zcore
import zcore.scala
from zcore.config import ConfigError, ZConfig
from zcore.scala import ScaLA, ScalaConfig, find_embedding, load_scala_config

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def loaded(scala: dict[str, Any]) -> Any:
    return ZConfig.load({**BASE, "scala": scala}).extension("scala")


def test_defaults_are_off_and_the_block_loads() -> None:
    assert ScalaConfig().enabled is False
    cfg = loaded({"enabled": True, "adv_steps": 2, "adv_step_size": 0.05, "adv_max_norm": 0.2})
    assert isinstance(cfg, ScalaConfig)
    assert (cfg.adv_steps, cfg.adv_step_size, cfg.adv_max_norm) == (2, 0.05, 0.2)
    assert load_scala_config(None) == ScalaConfig()


@pytest.mark.parametrize(
    ("block", "match"),
    [
        (
            {"enabled": True, "adv_max_norm": -1.0},
            r"scala\.adv_max_norm = -1\.0: must be >= 0",
        ),
        ({"enabled": True, "adv_steps": 0}, r"scala\.adv_steps = 0.*set adv_steps >= 1"),
        ({"enabled": True, "adv_steps": -2}, r"scala\.adv_steps"),
        (
            {"enabled": True, "adv_init_mag": 2.0, "adv_max_norm": 1.0},
            r"scala\.adv_init_mag = 2\.0: exceeds adv_max_norm 1\.0.*use adv_init_mag <= 1\.0",
        ),
        ({"enabled": True, "adv_step_size": 0.0}, r"scala\.adv_step_size = 0.*adv_step_size > 0"),
        ({"enabled": True, "adv_norm": "l1"}, r"scala\.adv_norm"),
        ({"enabled": "yes"}, r"scala\.enabled"),
        ({"enabled": True, "adv_lr": 0.1}, r"scala\.adv_lr"),  # a FreeLB key we do not read
        ({"enabled": True, "adv_max_nrom": 0.1}, r"scala\.adv_max_nrom.*adv_max_norm"),
    ],
)
def test_bad_blocks_fail_naming_the_key(block: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        loaded(block)
    with pytest.raises(ConfigError, match=match):  # and the same when handed over directly
        load_scala_config(block)


def test_zero_steps_are_fine_while_disabled() -> None:
    assert loaded({"enabled": False, "adv_steps": 0}).adv_steps == 0


class NoEmbeddingsAccessor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.out = nn.Linear(4, 1)


def test_embedding_by_name_or_accessor() -> None:
    model = NoEmbeddingsAccessor()
    assert find_embedding(model, "emb") == ("emb", model.emb)
    with pytest.raises(
        ConfigError, match=r"scala\.embedding = .embed.: is not a module.*\['emb'\]"
    ):
        find_embedding(model, "embed")
    with pytest.raises(ConfigError, match=r"scala\.embedding.*set scala\.embedding.*\['emb'\]"):
        find_embedding(model, None)
    model.get_input_embeddings = lambda: model.emb  # type: ignore[method-assign]
    assert find_embedding(model, None) == ("emb", model.emb)


def _engine(stage: int, scala: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    cfg = {**BASE, "zero_optimization": {"stage": stage}, "scala": scala}
    engine, *_ = zcore.initialize(NoEmbeddingsAccessor(), config=cfg)
    return engine


def test_stage3_is_refused_at_start_and_a_missed_embedding_is_named() -> None:
    with pytest.raises(
        ConfigError, match=r"zero_optimization\.stage = 3: scala runs on ZeRO stages 0-2"
    ):
        ScaLA(_engine(3, {"enabled": True, "embedding": "emb"}))
    engine = _engine(0, {"enabled": True, "embedding": "emb"})
    runner = ScaLA(engine)
    with pytest.raises(RuntimeError, match="loss_fn did not run `emb`"):
        runner.step(lambda: engine.module.out(torch.ones(2, 4)).sum())
    runner.close()
    assert not engine.module.emb._forward_hooks  # close() took the hook off

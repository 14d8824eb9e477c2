"""``tensor_parallel.autotp_size``: the config sizes ``tp`` and ``zcore.initialize`` cuts the model.

DeepSpeed's AutoTP key: with it, a plain model handed to ``zcore.initialize`` is cut by the
plan its config chooses, and trains bit for bit as the same model cut by
``zcore.tensor.parallelize`` before the engine; an explicit mesh of another ``tp`` fails
naming both sizes; DeepSpeed keys of the block zcore does not honour are refused.
"""

from __future__ import annotations

import pytest

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.tensor.common import global_batch, make_gpt
from tests.zcore.zero.common import config
from zcore.comm import MeshError, MeshSpec
from zcore.config import ConfigError, ZConfig
from zcore.tensor import VocabParallelEmbedding, parallelize

STEPS, MB = 3, 2


def test_block_parses_and_refuses_unhonoured_keys() -> None:
    cfg = ZConfig.load({**config(0), "tensor_parallel": {"autotp_size": 2}})
    assert cfg.extension("tensor_parallel").autotp_size == 2
    with pytest.raises(ConfigError, match=r"tensor_parallel\.partition_config"):
        ZConfig.load({**config(0), "tensor_parallel": {"autotp_size": 2, "partition_config": {}}})


def _losses(engine: zcore.ZEngine) -> list[float]:
    out = []
    for step in range(STEPS):
        x, y = global_batch(step, MB)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        out.append(float(loss.detach()))
    engine.destroy()
    return out


def _run(rank: int, world: int) -> dict:
    cfg = {**config(1, mb=MB, gas=1), "tensor_parallel": {"autotp_size": world}}
    auto, *_ = zcore.initialize(make_gpt(), config=cfg)
    out = {"tp": auto.mesh.spec.tp}
    out["cut"] = isinstance(auto.module.transformer.wte, VocabParallelEmbedding)
    out["auto"] = _losses(auto)
    spec = MeshSpec.resolve(world, tp=world)
    explicit, *_ = zcore.initialize(parallelize(make_gpt(), spec), config=cfg, mesh=spec)
    out["explicit"] = _losses(explicit)
    try:
        zcore.initialize(make_gpt(), config=cfg, mesh=MeshSpec.resolve(world))
    except MeshError as err:
        out["error"] = str(err)
    return out


def test_autotp_size_cuts_the_model_in_initialize() -> None:
    for out in run_ranks(_run, 2):
        assert out["tp"] == 2 and out["cut"]
        assert out["auto"] == out["explicit"]
        assert "tensor_parallel.autotp_size is 2 but the mesh has tp 1" in out["error"]

"""The ``cp`` axis: sizes checked up front, groups of consecutive ZeRO ranks, batch arithmetic
over the data-parallel ranks only."""

from __future__ import annotations

import pytest

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config, make_model
from zcore.comm import MeshError, MeshSpec
from zcore.comm.mesh import spec_from_config
from zcore.config import ZConfig


def test_cp_lives_inside_the_zero_axis() -> None:
    spec = MeshSpec.resolve(8, cp=2)
    assert (spec.dp, spec.cp, spec.data_parallel) == (8, 2, 4)
    assert spec.sizes()["cp"] == 2
    assert spec.formula().endswith("dp 8 = data 4 x cp 2")
    assert MeshSpec.resolve(4).formula() == "pp 1 x dp_replicate 1 x dp 4 x tp 1 = 4"


def test_sequence_parallel_size_sizes_cp() -> None:
    cfg = ZConfig.load(config(3, sequence_parallel_size=2))
    spec = spec_from_config(cfg, 4)
    assert (spec.dp, spec.cp, spec.data_parallel) == (4, 2, 2)


def test_cp_not_dividing_the_world_names_the_numbers() -> None:
    cfg = ZConfig.load(config(3, sequence_parallel_size=3))
    with pytest.raises(MeshError) as err:
        spec_from_config(cfg, 4)
    msg = str(err.value)
    for part in ("cp 3", "dp 4", "world size 4", "sequence_parallel_size 3", "divides 4"):
        assert part in msg, (part, msg)


def _cp_mesh(rank: int, world: int) -> dict:
    engine, *_ = zcore.initialize(make_model(), config=config(3, gas=1, sequence_parallel_size=2))
    mesh = engine.mesh
    return {
        "cp": (mesh.comm("cp").size, mesh.coordinate("cp")),
        "dp": (engine.comm.size, engine.comm.rank),
        "data": (engine.world_size, engine.data_rank),
        "batch": engine.batch.train_batch_size,
    }


@pytest.mark.slow(reason="4 ranks building a cp view beside the dp mesh: 15-30 s on 2 cores")
def test_cp2_dp2_groups_and_batch_arithmetic() -> None:
    out = run_ranks(_cp_mesh, 4)
    for rank, got in enumerate(out):
        assert got["cp"] == (2, rank % 2), got
        assert got["dp"] == (4, rank), got  # ZeRO cuts over dp x cp
        assert got["data"] == (2, rank // 2), got  # the cp ranks of a sequence read one batch
        assert got["batch"] == 4, got  # micro 2 x gas 1 x data 2

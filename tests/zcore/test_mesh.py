"""The job mesh: axis sizes checked up front, groups from torch's DeviceMesh, and ZeRO over
one axis of a 2x2 mesh equal to the single-process baseline.

Tolerances as in ``tests/zcore/zero/test_equivalence.py``: fp32 losses to 2e-5 absolute and
parameters to 1e-4 after 10 steps (summation order and the native AdamW kernel differ).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import baseline, config, full_params, make_model, train
from zcore.comm import MeshError, MeshSpec
from zcore.comm.mesh import spec_from_config
from zcore.config import ZConfig

STEPS = 10


def test_default_mesh_is_zero_over_every_rank() -> None:
    spec = MeshSpec.resolve(8)
    assert (spec.pp, spec.dp_replicate, spec.dp, spec.tp) == (1, 1, 8, 1)
    assert spec.sizes()["edp"] == 8
    assert spec.formula() == "pp 1 x dp_replicate 1 x dp 8 x tp 1 = 8"


def test_mics_shard_size_leaves_replicas() -> None:
    cfg = ZConfig.load(config(3, zero_optimization={"mics_shard_size": 2}))
    spec = spec_from_config(cfg, 8)
    assert (spec.dp_replicate, spec.dp, spec.data_parallel) == (4, 2, 8)


@pytest.mark.parametrize(
    ("kwargs", "numbers"),
    [
        ({"world": 6, "pp": 4}, ["world size 6", "pp 4", "tp 1", "= 4"]),
        ({"world": 4, "dp": 3}, ["dp 3", "world size 4", "= 4", "divides 4"]),
        ({"world": 8, "dp": 4, "dp_local": 3}, ["dp_local 3", "dp 4", "world size 8"]),
        ({"world": 4, "ep": 3}, ["ep 3", "dp_replicate 1", "dp 4", "= 4"]),
        ({"world": 4, "tp": 0}, ["tp 0"]),
    ],
)
def test_bad_mesh_names_every_number(kwargs: dict, numbers: list[str]) -> None:
    world = kwargs.pop("world")
    with pytest.raises(MeshError) as err:
        MeshSpec.resolve(world, **kwargs)
    for n in numbers:
        assert n in str(err.value), (n, str(err.value))


def test_bad_mics_shard_size_fails_at_start_naming_the_key() -> None:
    cfg = ZConfig.load(config(3, zero_optimization={"mics_shard_size": 3}))
    with pytest.raises(MeshError, match=r"dp 3 .*world size 4.*mics_shard_size 3"):
        spec_from_config(cfg, 4)


def _bad_mesh(rank: int, world: int) -> str:
    try:
        zcore.initialize(make_model(), config=config(3, zero_optimization={"mics_shard_size": 3}))
    except MeshError as err:
        return str(err)
    return "started"


def test_initialize_refuses_a_mesh_that_does_not_fit() -> None:
    for msg in run_ranks(_bad_mesh, 2):
        assert "dp 3" in msg and "world size 2" in msg and "mics_shard_size 3" in msg, msg


def _mics(rank: int, world: int, stage: int, ckpt: str) -> dict:
    engine, *_ = zcore.initialize(
        make_model(), config=config(stage, zero_optimization={"mics_shard_size": 2})
    )
    mesh = engine.mesh
    out = {
        "coords": mesh.coords(),
        "dp": (engine.comm.rank, engine.comm.size),
        "replica": (engine.replicas.rank, engine.replicas.size),
        "shard_world": engine.zopt.shard_world,
        "data_rank": engine.data_rank,
    }
    if stage == 3:  # each rank holds half of every partitioned parameter, not a quarter
        sp = next(sp for sp in engine.stage3.params.values() if not sp.persistent)
        out["shard_fraction"] = sp.shard.numel() / sp.shape.numel()
    out["losses"] = train(engine, STEPS)
    out["params"] = full_params(engine)
    if ckpt:
        engine.save_checkpoint(ckpt, tag="t")
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_over_two_ranks_of_a_2x2_mesh_matches_baseline(stage: int, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt") if stage == 3 else ""
    results = run_ranks(_mics, 4, args=(stage, ckpt))
    ref_losses, ref_params = baseline(STEPS, global_size=2 * 2 * 4)
    for rank, r in enumerate(results):
        # ranks (replica, dp): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1)
        assert r["coords"] == {"dp_replicate": rank // 2, "dp": rank % 2}
        assert r["dp"] == (rank % 2, 2) and r["replica"] == (rank // 2, 2)
        assert r["shard_world"] == 2 and r["data_rank"] == rank
        if stage == 3:
            assert 0.45 < r["shard_fraction"] <= 0.55, r["shard_fraction"]
        assert r["losses"] == pytest.approx(ref_losses, rel=2e-5, abs=2e-5)
        for name, ref in ref_params.items():
            torch.testing.assert_close(r["params"][name], ref, atol=1e-4, rtol=0, msg=name)
    if ckpt:  # replicas write their partition once; the manifest records the mesh
        root = Path(ckpt) / "t"
        assert sorted(p.name for p in root.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]
        manifest = json.loads((root / "manifest.json").read_text())
        assert manifest["mesh"]["dp_replicate"] == 2 and manifest["mesh"]["dp"] == 2
        # each file keyed by the writer's full mesh coordinates (replica 0 writes)
        at = {"pp": 0, "dp_replicate": 0, "tp": 0}
        assert manifest["files"] == {
            "rank_00000.pt": {**at, "dp": 0},
            "rank_00001.pt": {**at, "dp": 1},
        }


def _resume_on_plain_dp(rank: int, world: int, ckpt: str) -> list[float]:
    # 4 x 2 ranks x 2 micro-batches: the same 16-sample global batch as the 2x2 run
    engine, *_ = zcore.initialize(make_model(), config=config(3, mb=4))
    engine.load_checkpoint(ckpt, tag="t")
    return train(engine, 2, start=STEPS)


def test_mesh_checkpoint_loads_on_another_mesh(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_mics, 4, args=(3, ckpt))
    resumed = run_ranks(_resume_on_plain_dp, 2, args=(ckpt,))
    ref, _ = baseline(STEPS + 2, global_size=16)
    for losses in resumed:
        assert losses == pytest.approx(ref[STEPS:], rel=2e-5, abs=2e-5)

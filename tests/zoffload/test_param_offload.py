"""ZeRO-Infinity parameter offload (stage 3): shards in host memory or a swap file train the
same as shards in memory, across a checkpoint, and leave memory when swapped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config, make_model, train
from tests.zoffload.equivalence import assert_matches, offload_vs_plain

TILE = 2048


def _offload(device: str, path: Path, params: bool = True) -> dict[str, Any]:
    if device == "cpu":
        return {"device": "cpu", "pin_memory": True}
    path.mkdir(parents=True, exist_ok=True)
    block = {"device": "nvme", "nvme_path": str(path), "buffer_count": 2}
    return {**block, "buffer_size": 4096} if params else block


# "cpu" is the in-memory path on a machine without a GPU: slow-only here
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow), "nvme"])
def test_param_and_optimizer_offload_match_plain_stage3(device: str, tmp_path: Path) -> None:
    opt = _offload(device, tmp_path / "opt", params=False)
    zero = {"offload_param": _offload(device, tmp_path / "params"), "sub_group_size": TILE}
    args = (3, opt, str(tmp_path / "ckpt"), 10, zero)
    for got in run_ranks(offload_vs_plain, 2, args=args, timeout=300):
        assert_matches(got)
    if device == "nvme":
        assert list((tmp_path / "params").iterdir()) == []  # swap removed with the engines


def _held(rank: int, world: int, root: str) -> dict[str, Any]:
    zero = {"offload_param": _offload("nvme", Path(root))}
    engine, *_ = zcore.initialize(make_model(), config=config(3, zero_optimization=zero))
    train(engine, 2)
    s3 = engine.stage3
    store = s3.store
    out = {
        "store": type(store).__name__,
        "in_memory": sum(sp.shard.numel() for sp in s3.params.values()),
        "persistent": sum(sp.shard_size for sp in s3.params.values() if sp.persistent),
        "swapped": sum(s3.params[p].shard_size for p in store.offsets),
        "file_bytes": store.nvme_bytes(),
    }
    engine.destroy()
    return out


def test_swapped_shards_leave_memory(tmp_path: Path) -> None:
    for got in run_ranks(_held, 2, args=(str(tmp_path / "params"),)):
        assert got["store"] == "NvmeShards"
        assert got["in_memory"] == got["persistent"]  # only the persistent small ones
        assert got["swapped"] > 0
        assert got["file_bytes"] >= 4 * got["swapped"]


def _small_buffers(rank: int, world: int, root: str) -> str:
    off = {"device": "nvme", "nvme_path": root, "buffer_count": 2, "buffer_size": 64}
    cfg = config(3, zero_optimization={"offload_param": off})
    try:
        zcore.initialize(make_model(), config=cfg)
    except ValueError as err:
        return str(err)
    return "started"


def test_buffer_smaller_than_a_shard_fails_at_start(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    for message in run_ranks(_small_buffers, 2, args=(str(tmp_path / "p"),)):
        assert "offload_param.buffer_size = 64" in message and "raise buffer_size" in message


def _built_offloaded(rank: int, world: int, root: str) -> dict[str, Any]:
    from tests.zcore.zero.common import full_params
    from zcore.zero import Init

    cfg = config(3, zero_optimization={"offload_param": _offload("nvme", Path(root))})
    with Init(config=cfg) as init:
        model = make_model()
    s3 = init.stage3
    assert s3 is not None
    in_memory = sum(sp.shard.numel() for sp in s3.params.values())
    persistent = sum(sp.shard_size for sp in s3.params.values() if sp.persistent)
    engine, *_ = zcore.initialize(model, config=cfg)
    same_store = engine.stage3.store is s3.store
    train(engine, 3)
    got = full_params(engine)
    engine.destroy()
    plain, *_ = zcore.initialize(make_model(), config=config(3))
    train(plain, 3)
    want = full_params(plain)
    plain.destroy()
    return {
        "in_memory": in_memory,
        "persistent": persistent,
        "same_store": same_store,
        "got": got,
        "want": want,
    }


def test_zero_init_swaps_shards_out_as_the_model_is_built(tmp_path: Path) -> None:
    import torch

    for r in run_ranks(_built_offloaded, 2, args=(str(tmp_path / "p"),)):
        assert r["in_memory"] == r["persistent"] and r["same_store"]
        for name, value in r["want"].items():
            torch.testing.assert_close(r["got"][name], value, atol=1e-5, rtol=0, msg=name)

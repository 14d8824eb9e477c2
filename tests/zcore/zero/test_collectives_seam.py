"""The collectives seam: a plug-in registered from outside zcore carries every ZeRO bucket
and parameter gather, combined with NVMe optimizer offload in the same run.

The plug-in rounds what it sends to bfloat16 (a stand-in for zcomm's quantized wire), so
training must track the plain fp32 run the way bf16 training does: each parameter's
distance from the plain run's at most 0.25 of how far the plain run moved it (the bound of
``test_equivalence``'s bf16 runs), losses within 1%.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config, full_params, make_model, train
from zcore.comm import Comm, Handle
from zcore.zero.collectives import (
    Collectives,
    collectives_for,
    register_collectives,
    unregister_collectives,
)

STEPS = 6


class Bf16Wire(Collectives):
    """Rounds every payload to bfloat16 before it leaves the rank; counts what it carried."""

    name = "test-bf16-wire"

    def __init__(self) -> None:
        self.calls: dict[str, int] = {"reduce_scatter": 0, "all_reduce": 0, "all_gather": 0}

    def reduce_scatter(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        self.calls["reduce_scatter"] += 1
        return super().reduce_scatter(comm, out, inp.copy_(inp.bfloat16()), what)

    def all_reduce(self, comm: Comm, buf: torch.Tensor, what: str) -> Handle:
        self.calls["all_reduce"] += 1
        return super().all_reduce(comm, buf.copy_(buf.bfloat16()), what)

    def all_gather(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        self.calls["all_gather"] += 1
        return super().all_gather(comm, out, inp.bfloat16().to(inp.dtype), what)


def _plug_and_offload(rank: int, world: int, stage: int, nvme: str) -> dict[str, Any]:
    plain, *_ = zcore.initialize(make_model(), config=config(stage))
    plain_losses = train(plain, STEPS)
    plain_params = full_params(plain)
    plain.destroy()

    wire = Bf16Wire()
    register_collectives(wire.name, lambda cfg, mesh: wire)
    try:
        offload = {"device": "nvme", "nvme_path": nvme}
        cfg = config(
            stage,
            zero_optimization={"offload_optimizer": offload, "sub_group_size": 1024},
            aio={"block_size": 4096, "queue_depth": 8},
        )
        engine, *_ = zcore.initialize(make_model(), config=cfg)
        losses = train(engine, STEPS)
        params = full_params(engine)
        kind = type(engine.zopt.store).__name__
        engine.destroy()
    finally:
        unregister_collectives(wire.name)
    return {
        "plain_losses": plain_losses,
        "plain_params": plain_params,
        "losses": losses,
        "params": params,
        "calls": wire.calls,
        "zopt": kind,
        "init": make_model().state_dict(),
    }


@pytest.mark.parametrize("stage", [3])
def test_plugged_collectives_with_nvme_offload_track_plain_training(
    stage: int, tmp_path: Path
) -> None:
    (tmp_path / "nvme").mkdir()
    results = run_ranks(_plug_and_offload, 2, args=(stage, str(tmp_path / "nvme")), timeout=300)
    for got in results:
        assert got["zopt"] == "NvmeStore"
        # the plug-in carried the gradient buckets and the parameter gathers
        assert got["calls"]["all_reduce"] + got["calls"]["reduce_scatter"] >= STEPS
        assert got["calls"]["all_gather"] >= STEPS
        assert got["losses"] == pytest.approx(got["plain_losses"], rel=1e-2)
        for name, ref in got["plain_params"].items():
            moved = float((ref - got["init"][name]).norm())
            off = float((got["params"][name] - ref).norm())
            assert moved > 0 and off <= 0.25 * moved, (name, off / moved)
        # and it did change what travelled: not bit-identical to the plain run
        assert any(not torch.equal(got["params"][n], got["plain_params"][n]) for n in got["params"])


def test_two_claiming_collectives_are_refused_by_name() -> None:
    register_collectives("a-wire", lambda cfg, mesh: Collectives())
    register_collectives("b-wire", lambda cfg, mesh: Collectives())
    try:
        with pytest.raises(ValueError, match=r"`a-wire`, `b-wire`"):
            collectives_for(None, None)
    finally:
        unregister_collectives("a-wire")
        unregister_collectives("b-wire")


def test_default_is_full_precision() -> None:
    assert type(collectives_for(None, None)) is Collectives

"""1-bit Adam, 0/1 Adam and 1-bit LAMB in zcore's engine on real gloo ranks, at ZeRO stages
0, 1 and 2 (stages 1-2 through the compressed reduce-scatter).

- Against the uncompressed run of the same optimizer (``freeze_step`` past the end: the same
  update rule on fully averaged gradients): identical before the freeze, no divergence
  after it (``TAIL_TOL``), and every rank holds the same weights (not 0/1 Adam at stage 0,
  whose local steps let them drift between synchronizations).
- 1-bit Adam's compressed momentum equals :func:`zcomm.reference_compressed_allreduce`'s
  exactly, on 2 and 4 ranks.
- A checkpoint saved mid-compression (0/1 Adam: between two synchronizations, weights
  drifted apart), loaded into a fresh engine, continues bit for bit like the run that was
  never interrupted: error buffers, accumulators and drift are saved per rank.
- Configs it cannot run fail at start naming the key and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config, full_params, make_model, train
from zcomm import reference_compressed_allreduce
from zcomm.compressed_scatter import (
    CompressedReduceScatter,
    reference_compressed_reduce_scatter,
)
from zcomm.optim import OneBitAdam
from zcore.comm.mesh import MeshSpec, job_mesh
from zcore.zero.communicating import OptimizerContext

# About 60 s in all on a quiet 2-core machine: the xdist workers start this file first.
pytestmark = pytest.mark.heavy(60)

STEPS, FREEZE = 20, 6

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "OneBitAdam": {"lr": 3e-3, "weight_decay": 0.01, "freeze_step": FREEZE},
    "ZeroOneAdam": {
        "lr": 3e-3,
        "weight_decay": 0.01,
        "var_freeze_step": FREEZE,
        "var_update_scaler": 3,
        "local_step_scaler": 3,
        "local_step_clipper": 4,
        "preconditioned": True,
    },
    "OneBitLamb": {"lr": 3e-3, "weight_decay": 0.01, "freeze_step": FREEZE, "max_coeff": 0.5},
}
# The mean loss of the last 5 steps, relative to the uncompressed run's (measured: 1-bit
# Adam +3.3%, 1-bit LAMB +4.1%, 0/1 Adam +30%: 14 compressed steps of a toy whose loss
# falls from 22 to 4.6 on random tokens; `z train` holds them to 2% on real text).
TAIL_TOL = {"OneBitAdam": 0.08, "OneBitLamb": 0.08, "ZeroOneAdam": 0.45}
NEVER = {"freeze_step": 10**6, "var_freeze_step": 10**6}


GATHER = "+gather"  # a kind suffix: 1-bit Adam with compressed_weight_gather on (its default)


def _cfg(kind: str, compressed: bool, stage: int = 0, **extra: Any) -> dict:
    gather = kind.endswith(GATHER)
    kind = kind.removesuffix(GATHER)
    params = dict(OPTIMIZERS[kind])
    if kind == "OneBitAdam":  # plain "OneBitAdam" runs stages 1-2 with the fp32 gather
        params["compressed_weight_gather"] = gather
    if not compressed:
        params.update({k: v for k, v in NEVER.items() if k in params})
        if kind == "ZeroOneAdam":
            params["var_update_scaler"] = 10**6  # the variance from every step's average
    return config(stage, optimizer={"type": kind, "params": params}, **extra)


def _train(
    rank: int, world: int, kind: str, compressed: bool, stage: int
) -> tuple[list[float], Any, int]:
    engine, *_ = zcore.initialize(make_model(), config=_cfg(kind, compressed, stage))
    losses = train(engine, STEPS)
    return losses, full_params(engine), engine.optimizer.bytes_sent


SLOW = pytest.mark.slow
RUNS = [
    ("OneBitAdam", 0),
    pytest.param("ZeroOneAdam", 0, marks=SLOW),
    pytest.param("OneBitLamb", 0, marks=SLOW),
    pytest.param("OneBitAdam", 1, marks=SLOW),
    ("OneBitAdam", 2),
    pytest.param("ZeroOneAdam", 1, marks=SLOW),
    ("ZeroOneAdam", 2),
    ("OneBitLamb", 1),
    pytest.param("OneBitLamb", 2, marks=SLOW),
    ("OneBitAdam" + GATHER, 2),
]
RESUMES = [
    pytest.param("OneBitAdam", 0, marks=SLOW),
    ("ZeroOneAdam", 0),  # mid-interval: weights, momentum and accumulator differ per rank
    ("OneBitLamb", 0),
    ("OneBitAdam", 2),
    ("ZeroOneAdam", 2),  # mid-interval: every rank's own model rows (zero_one_replica)
    pytest.param("OneBitLamb", 1, marks=SLOW),
    ("OneBitAdam" + GATHER, 2),  # the server errors come back exactly
]


@pytest.mark.parametrize(("kind", "stage"), RUNS)
def test_compressed_training_tracks_the_uncompressed_run(kind: str, stage: int) -> None:
    plain = run_ranks(_train, 2, args=(kind, False, stage), timeout=120)
    packed = run_ranks(_train, 2, args=(kind, True, stage), timeout=120)
    ref_losses = plain[0][0]
    tail = slice(STEPS - 5, STEPS)
    for losses, _, _ in packed:
        exact = (
            4 if kind.startswith("ZeroOneAdam") else FREEZE + 1
        )  # 0/1 Adam compresses from step 5
        assert losses[:exact] == pytest.approx(ref_losses[:exact], rel=1e-5)
        mean, ref = sum(losses[tail]) / 5, sum(ref_losses[tail]) / 5
        tol = TAIL_TOL[kind.removesuffix(GATHER)]
        assert abs(mean - ref) <= tol * ref, (kind, mean, ref)
    if not kind.startswith("ZeroOneAdam"):  # 0/1 Adam's local steps drift (fp32: every stage)
        for name, value in packed[0][1].items():
            assert torch.equal(value, packed[1][1][name]), name
    assert plain[0][2] == 0 and packed[0][2] > 0


def _onebit_exact(rank: int, world: int) -> list[str]:
    comm = job_mesh(MeshSpec.resolve(world), 60.0).comm("dp")
    n, steps, freeze = 37, 6, 2
    master = torch.linspace(-1, 1, n)
    opt = OneBitAdam([{"params": [master.clone()]}], lr=0.01, freeze_step=freeze)
    opt.bind(OptimizerContext(comm, 0, [[("w", 0, n)]]))
    p = opt.param_groups[0]["params"][0]
    ref_p, ref_m, ref_v = master.clone(), torch.zeros(n), torch.zeros(n)
    errors: tuple[Any, Any] = (None, None)
    failures = []
    for step in range(steps):
        grads = [
            torch.randn(n, generator=torch.Generator().manual_seed(10 * step + r))
            for r in range(world)
        ]
        frozen = step >= freeze
        mean = torch.stack(grads).mean(0)
        p.grad = grads[rank].clone() if frozen else mean.clone()
        opt.step()
        # the reference (same torch ops, so the same bits): every rank's momentum,
        # averaged by the single-process model of the compressed all-reduce
        if frozen:
            ms = [ref_m.clone().mul_(0.9).add_(g, alpha=1 - 0.9) for g in grads]
            outs, w, s = reference_compressed_allreduce(ms, *errors)
            errors, ref_m = (w, s), outs[0]
        else:
            ref_m = ref_m.clone().mul_(0.9).add_(mean, alpha=1 - 0.9)
            ref_v = ref_v.clone().mul_(0.999).addcmul_(mean, mean, value=1 - 0.999)
        ref_p = ref_p - 0.01 * (ref_m / (ref_v.sqrt() + 1e-8))
        if not torch.equal(opt.state[p]["exp_avg"], ref_m):
            failures.append(f"rank {rank} step {step}: momentum differs")
        if not torch.allclose(p, ref_p, rtol=0, atol=1e-6):
            failures.append(f"rank {rank} step {step}: weights differ by {(p - ref_p).abs().max()}")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_onebit_adam_momentum_equals_the_reference(world: int) -> None:
    for failures in run_ranks(_onebit_exact, world, timeout=90):
        assert failures == []


def _replayed(rank: int, world: int, kind: str, stage: int) -> tuple[bool, int, int]:
    """After compressed steps with the replayed gather: does this rank's model hold its
    master slots bit for bit, and how many bytes did the last step send (with, without)?"""
    from zcore.zero.layout import slot_view

    out = []
    for gather in (True, False):
        params = dict(OPTIMIZERS[kind], compressed_weight_gather=gather)
        cfg = config(stage, optimizer={"type": kind, "params": params})
        engine, *_ = zcore.initialize(make_model(), config=cfg)
        train(engine, STEPS)
        zopt, masters = engine.zopt, engine.zopt.master_for_save()
        same = True
        for p in engine.module.parameters():
            g, shard = zopt.where[p]
            slot = slot_view(p.data.reshape(-1), shard, world)[rank]
            same &= torch.equal(slot, masters[g][shard.offset : shard.offset + shard.shard_size])
        out.append((same, engine.comm_bytes_last_step().total))
        engine.destroy()
    return out[0][0], out[0][1], out[1][1]


@pytest.mark.parametrize(
    ("kind", "stage"), [pytest.param("OneBitAdam", 1, marks=SLOW), ("OneBitAdam", 2)]
)
def test_replayed_gather_keeps_model_and_master_equal(kind: str, stage: int) -> None:
    """1-bit Adam's default at stages 1-2 (compressed_weight_gather): the weights'
    all-gather sends the owners' 1-bit momentum and every rank replays their updates
    (zcomm.optim.momentum_gather). The model then holds
    the master bit for bit, and a step sends several times fewer bytes than with the fp32
    gather (on this toy model the gradients' reduce-scatter and small buckets dominate;
    z train measured 32x against an fp32 all-reduce)."""
    for same, replayed, fp32 in run_ranks(_replayed, 2, args=(kind, stage), timeout=120):
        assert same
        assert replayed * 4 < fp32, (replayed, fp32)


def _resume(rank: int, world: int, kind: str, stage: int, root: str) -> tuple[Any, Any]:
    cfg = _cfg(kind, True, stage)
    straight, *_ = zcore.initialize(make_model(), config=cfg)
    first = train(straight, 7)
    straight.save_checkpoint(root, tag="mid")
    rest = train(straight, 5, start=7)
    ref = full_params(straight)
    straight.destroy()
    resumed, *_ = zcore.initialize(make_model(seed=3), config=cfg)
    resumed.load_checkpoint(root, tag="mid")
    again = train(resumed, 5, start=7)
    got = full_params(resumed)
    same = all(torch.equal(got[k], ref[k]) for k in ref)
    return (first, rest, again), same


@pytest.mark.parametrize(("kind", "stage"), RESUMES)
def test_checkpoint_mid_compression_resumes_exactly(kind: str, stage: int, tmp_path: Path) -> None:
    args = (kind, stage, str(tmp_path))
    for (_, rest, again), same in run_ranks(_resume, 2, args=args, timeout=150):
        assert again == rest
        assert same


@pytest.mark.parametrize(
    ("kind", "stage"), [("OneBitAdam", 3), ("ZeroOneAdam", 3), ("OneBitLamb", 3)]
)
def test_unsupported_stages_are_refused_naming_the_key(kind: str, stage: int) -> None:
    cfg = config(stage, optimizer={"type": kind, "params": {}})
    with pytest.raises(ValueError, match=rf"(?s)optimizer.type {kind}.*zero_optimization.stage"):
        zcore.initialize(make_model(), config=cfg)  # one process: the check needs no ranks


def test_negative_freeze_step_is_refused_at_load() -> None:
    from zcore.config import ZConfig

    with pytest.raises(ValueError, match=r"optimizer\.params\.freeze_step"):
        ZConfig.load(config(0, optimizer={"type": "OneBitAdam", "params": {"freeze_step": -1}}))


def _scatter_exact(rank: int, world: int) -> list[str]:
    comm = job_mesh(MeshSpec.resolve(world), 60.0).comm("dp")
    scatter = CompressedReduceScatter(comm)
    errors = None
    failures = []
    for call in range(3):
        for cols in (1, 13, 40):
            gen = torch.Generator().manual_seed(100 * call + cols)
            grids = [torch.randn(world, cols, generator=gen) for _ in range(world)]
            out = scatter(grids[rank], f"g{cols}")
            outs, new = reference_compressed_reduce_scatter(
                grids, None if call == 0 else errors[cols]
            )
            errors = {**(errors or {}), cols: new}
            if not torch.equal(out, outs[rank]):
                failures.append(f"rank {rank} call {call} cols {cols}: row differs")
            if not torch.equal(scatter.errors[f"g{cols}"], new[rank]):
                failures.append(f"rank {rank} call {call} cols {cols}: error differs")
            if scatter.last_bytes != world * (-(-cols // 8) + 4):
                failures.append(f"rank {rank}: sent {scatter.last_bytes} bytes")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_reduce_scatter_equals_the_reference(world: int) -> None:
    for failures in run_ranks(_scatter_exact, world, timeout=90):
        assert failures == []


def test_nvme_optimizer_offload_is_refused_naming_the_key(tmp_path: Path) -> None:
    offload = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg = config(
        1,
        optimizer={"type": "OneBitAdam", "params": {}},
        zero_optimization={"offload_optimizer": offload, "sub_group_size": 1024},
        aio={"block_size": 4096, "queue_depth": 8},
    )
    with pytest.raises(ValueError, match=r"offload_optimizer\.device.*nvme.*OneBitAdam"):
        zcore.initialize(make_model(), config=cfg)


def _mics(rank: int, world: int) -> str:
    cfg = config(
        1, optimizer={"type": "ZeroOneAdam", "params": {}}, zero_optimization={"mics_shard_size": 1}
    )
    try:
        zcore.initialize(make_model(), config=cfg)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_mics_replicas_are_refused_naming_the_key() -> None:
    for message in run_ranks(_mics, 2, timeout=60):
        assert "mics_shard_size" in message and "optimizer.type ZeroOneAdam" in message


@pytest.mark.parametrize("kind", ["ZeroOneAdam", "OneBitLamb"])
def test_compressed_weight_gather_is_refused_where_it_diverged(kind: str) -> None:
    cfg = config(2, optimizer={"type": kind, "params": {"compressed_weight_gather": True}})
    with pytest.raises(ValueError, match=r"compressed_weight_gather is supported by OneBitAdam"):
        zcore.initialize(make_model(), config=cfg)


def _bytes_per_step(rank: int, world: int, stage: int) -> tuple[list[int], list[int]]:
    """Wire bytes of this rank per step: 0/1 Adam, and AdamW at the same stage."""
    out = []
    for cfg in (_cfg("ZeroOneAdam", True, stage), config(stage)):
        engine, *_ = zcore.initialize(make_model(), config=cfg)
        steps = []
        for step in range(STEPS):
            train(engine, 1, start=step)
            steps.append(engine.comm_bytes_last_step().total)
        engine.destroy()
        out.append(steps)
    return out[0], out[1]


@pytest.mark.slow  # four 2-rank runs (~40 s quiet); the stage-2 tracking and resume cases run in CI
def test_zero_one_adam_at_stage_2_sends_what_stage_0_sends() -> None:
    """With fp32 parameters 0/1 Adam at stages 1-2 computes the weights' all-gather instead
    of sending it (zcomm.optim.zero_one_replica): after the freeze a step sends what stage
    0's does, times two at a synchronization (the sums A and B), not ZeRO's fp32
    all-gather; over the run it sends a fraction of AdamW's bytes at the same stage."""
    (s0, _), _ = run_ranks(_bytes_per_step, 2, args=(0,), timeout=120)
    (s2, adam2), _ = run_ranks(_bytes_per_step, 2, args=(2,), timeout=120)
    after = slice(FREEZE + 1, STEPS)
    assert sum(s2[after]) <= 2.2 * sum(s0[after]), (s2, s0)
    assert min(s2[after]) < 100  # local steps: only the clipping norm's scalar
    assert sum(s2) < sum(adam2) / 3, (sum(s2), sum(adam2))

"""The pipeline engine's dp-1 shortcuts change no number: where a stage's fp32 master is its
fp32 parameters laid end to end (one slot per parameter), the parameters become views of the
master (:meth:`~zcore.zero.store.OptimizerStore.share_params`, so publishing copies nothing),
stage 0-1's gradient partitions are kept between steps instead of allocated each step, and
the schedule accumulates ``.grad`` straight into them (:mod:`zcore.pipe.grad_views`).

pp 2 on 2 ranks (tied embedding across the stages), ZeRO 1-2: 4 steps with the shortcuts
and 4 without (``share_params`` switched off, partitions dropped each step) give the same
losses and parameters bit for bit. Stage 3 keeps both apart; a bf16 model its master."""

from __future__ import annotations

from typing import Any

import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.pipe.common import config, local_params, make_pipe, micro_batches, train
from zcore.zero.store import MemoryStore

STEPS, MB, GAS = 4, 2, 4


def _plain(store: MemoryStore) -> int:
    """What the engine ran before the shortcuts: no sharing, partitions per cycle."""
    store.keep_grad_partitions = False
    return 0


def _shares_storage(p: torch.Tensor, master: torch.Tensor) -> bool:
    return p.untyped_storage().data_ptr() == master.untyped_storage().data_ptr()


def _run(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for stage in (1, 2):
        engine, *_ = zcore.initialize(make_pipe(2), config=config(stage, mb=MB, gas=GAS))
        store = engine.zopt.store
        shared = all(
            _shares_storage(p, engine.zopt.master[engine.zopt.where[p][0]])
            for p in engine.module.parameters()
        )
        views = engine.grad_views.active
        losses = train(engine, 1, MB, GAS)
        views = views and all(p.grad is None for p in engine.module.parameters())
        kept = [t.data_ptr() for t in store._kept if t is not None]
        for step in range(1, STEPS):  # train()'s later steps, one at a time
            losses.append(_step(engine, step))
        still = [t.data_ptr() for t in store._kept if t is not None]
        master = sum(m.numel() * m.element_size() for m in store.master)
        out[f"bytes{stage}"] = (store.optimizer_bytes(), master)
        out[f"fast{stage}"] = (losses, local_params(engine), shared and views, kept, still)
        engine.destroy()

        original = MemoryStore.share_params
        MemoryStore.share_params = _plain  # type: ignore[method-assign]
        try:
            engine, *_ = zcore.initialize(make_pipe(2), config=config(stage, mb=MB, gas=GAS))
        finally:
            MemoryStore.share_params = original  # type: ignore[method-assign]
        assert not engine.grad_views.active
        losses = train(engine, STEPS, MB, GAS)
        out[f"plain{stage}"] = (losses, local_params(engine), engine.zopt.store._kept)
        out[f"plain_bytes{stage}"] = engine.zopt.store.optimizer_bytes()
        engine.destroy()
    for name, extra in (("stage3", {}), ("bf16", {"bf16": {"enabled": True}})):
        stage = 3 if name == "stage3" else 1
        engine, *_ = zcore.initialize(make_pipe(2), config=config(stage, **extra))
        out[name] = (engine.zopt.store.share_params(), engine.grad_views.active)
        engine.destroy()
    return out


def _step(engine: Any, step: int) -> float:
    """``train``'s step ``step`` alone."""
    batch = micro_batches(step, engine.world_size, MB, GAS)[engine.data_rank]
    return float(engine.train_batch(iter(batch)))


def test_dp1_master_shares_parameters_bit_for_bit() -> None:
    for rank, out in enumerate(run_ranks(_run, 2, timeout=300)):
        for stage in (1, 2):
            losses, params, shared, kept, still = out[f"fast{stage}"]
            plain_losses, plain_params, plain_kept = out[f"plain{stage}"]
            assert shared, (
                f"rank {rank} stage {stage}: parameters/grads are not master/partition views"
            )
            assert kept and kept == still, f"rank {rank} stage {stage}: partition not kept"
            if stage < 2:
                assert all(t is None for t in plain_kept)
            shared_bytes, master = out[f"bytes{stage}"]  # a shared master is the parameters'
            assert shared_bytes == out[f"plain_bytes{stage}"] - master > 0, (rank, stage)
            assert losses == plain_losses, (rank, stage, losses, plain_losses)
            assert params.keys() == plain_params.keys()
            for k in params:
                assert torch.equal(params[k], plain_params[k]), (rank, stage, k)
        assert out["stage3"] == (0, False), (rank, out["stage3"])
        assert out["bf16"][0] == 0, (rank, out["bf16"])  # bf16 gradients may be views

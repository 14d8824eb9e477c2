"""cp x tp: the GPT cut over tp = 2 (Megatron's layout, `zcore.tensor.parallelize`) and each
sequence split over cp = 2 (`ztrain.gpt_cp.sequence_parallel` after the cut: each tp rank's
2 of 4 heads span the cp ranks) on 4 ranks, ZeRO-3, trains like one process on the whole
sequences: 10 steps of 15-token sequences (cp does not divide them), ring (zig-zag) and
Ulysses. Tolerance: per-step losses rtol 1e-5, every gathered weight 2e-5 absolute (fp32
summation order, lr 1e-3). Cutting over tp after the cp split is refused at the start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.distributed import run_ranks
from tests.ztrain.test_train_cp import CLIP, LR, MB, WD, _ds_config
from ztrain.gpt import GPT, GPTConfig
from ztrain.train_options import TrainOptions
from ztrain.train_plan import plan_run

CFG = GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_embd=24, block_size=16)
STEPS, SEQ = 10, 15


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(13)
    return [torch.randint(0, CFG.vocab_size, (MB, SEQ + 1), generator=g) for _ in range(STEPS)]


def _rank(rank: int, world: int, data: list[torch.Tensor], mode: str) -> dict[str, Any]:
    import zcore
    from zcore.comm import MeshSpec
    from zcore.tensor import gather_full_state_dict, parallelize
    from ztrain.gpt_cp import sequence_parallel

    config = {
        **_ds_config(2, 3),
        "sequence_parallel_mode": mode,
        "tensor_parallel": {"autotp_size": 2},
    }
    spec = MeshSpec.resolve(world, tp=2, cp=2)
    model = sequence_parallel(parallelize(GPT(CFG, seed=0), spec))
    engine, *_ = zcore.initialize(model, config=config, mesh=spec)
    losses = []
    for batch in data:  # every rank reads the same sequences: one data rank
        _, loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "weights": gather_full_state_dict(engine.module)}


def _baseline(data: list[torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = GPT(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for batch in data:
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.slow(reason="4 gloo ranks x 10 ZeRO-3 steps of a tp-cut GPT: ~30 s on 2 cores")
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_gpt_at_cp2_tp2_trains_like_one_process(mode: str) -> None:
    data = _batches()
    results = run_ranks(_rank, 4, args=(data, mode), timeout=300)
    want_losses, want = _baseline(data)
    for r in results:
        assert r["losses"] == pytest.approx(want_losses, rel=1e-5)
        for name, w in want.items():
            torch.testing.assert_close(r["weights"][name], w, rtol=0, atol=2e-5, msg=name)
    assert want_losses[-1] < want_losses[0]


def _cut_late(rank: int, world: int) -> str:
    import zcore
    from zcore.comm import MeshSpec
    from zcore.tensor import parallelize
    from ztrain.gpt_cp import sequence_parallel

    spec = MeshSpec.resolve(world, tp=2, cp=2)
    model = parallelize(sequence_parallel(GPT(CFG, seed=0)), spec)
    import torch.distributed as dist

    try:
        zcore.initialize(model, config={**_ds_config(2, 1), "tensor_parallel": {"autotp_size": 2}})
        out = "ran"
    except ValueError as err:
        out = str(err)
    dist.barrier()  # no rank leaves while a peer still joins a group
    return out


@pytest.mark.slow(reason="4 gloo ranks")
def test_a_tp_cut_after_the_cp_split_is_refused() -> None:
    for msg in run_ranks(_cut_late, 4):
        assert "cut over tp after" in msg and "then call sequence_parallel" in msg, msg


def test_cp_tp_plans_its_layout(tmp_path: Path) -> None:
    opts = TrainOptions(
        out=tmp_path / "run", preset="tiny", cp=2, tp=2, cp_mode="ring", explicit=frozenset()
    )
    plan = plan_run(opts, 8)
    assert (plan.layout.cp, plan.layout.tp) == (2, 2)
    config = plan.config.config
    assert (config.sequence_parallel_size, config.sequence_parallel_mode) == (2, "ring")
    assert config.batch_sizes(2).train_batch_size == 16  # 8 ranks / (tp 2 x cp 2) x 8

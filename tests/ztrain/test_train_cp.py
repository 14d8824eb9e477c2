"""`z train --cp N`: the GPT with each sequence split over `cp` ranks (Ulysses,
`ztrain.gpt_cp`) trains like one process on the whole sequences, and bad input fails at the
start naming the numbers and the fix.

The equivalence: 3 heads (split 2 + 1 at cp=2), 11-token sequences (slices of 6 and 5),
ZeRO-3 (and, slow, ZeRO-1 and 2) on 2 ranks against the plain GPT with torch's AdamW in one process: per-step losses
and every final weight within fp32 summation-order tolerance (rtol 1e-5; weights 1e-5
absolute, a few % of one lr 1e-3 step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.distributed import run_ranks
from ztrain.gpt import GPT, GPTConfig
from ztrain.train_options import TrainError, TrainOptions
from ztrain.train_plan import plan_run

CFG = GPTConfig(vocab_size=64, n_layer=2, n_head=3, n_embd=24, block_size=16)
LR, WD, CLIP, STEPS, SEQ, MB = 1e-3, 0.1, 1.0, 4, 11, 2


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, CFG.vocab_size, (MB, SEQ + 1), generator=g) for _ in range(STEPS)]


def _ds_config(cp: int, stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "sequence_parallel_size": cp,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "comm_timeout_s": 60,
    }


def _rank(rank: int, world: int, data: list[torch.Tensor], stage: int) -> dict[str, Any]:
    import zcore
    from zcore.sequence import SequenceParallelError
    from zcore.zero import GatheredParameters
    from ztrain.gpt_cp import sequence_parallel

    model = sequence_parallel(GPT(CFG, seed=0))
    engine, *_ = zcore.initialize(model, config=_ds_config(world, stage))
    losses = []
    for batch in data:  # both ranks read the same sequences: one data rank
        _, loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with pytest.raises(SequenceParallelError, match="1 tokens cannot be split over cp 2"):
        engine(data[0][:, :1], data[0][:, 1:2])
    with GatheredParameters(list(model.parameters()), enabled=stage == 3):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "weights": weights, "data": (engine.world_size, engine.data_rank)}


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


SLOW = pytest.mark.slow(reason="the same 2-rank run at ZeRO-1/2: ~35 s each under load")


@pytest.mark.parametrize("stage", [3, pytest.param(1, marks=SLOW), pytest.param(2, marks=SLOW)])
def test_gpt_at_cp2_trains_like_one_process_on_the_whole_sequence(stage: int) -> None:
    data = _batches()
    results = run_ranks(_rank, 2, args=(data, stage), timeout=120)
    want_losses, want = _baseline(data)
    for r in results:
        assert r["data"] == (1, 0)  # the cp ranks of a sequence are one data rank
        assert r["losses"] == pytest.approx(want_losses, rel=1e-5)
        for name, w in want.items():
            torch.testing.assert_close(r["weights"][name], w, rtol=0, atol=1e-5, msg=name)
    assert want_losses[-1] < want_losses[0]


def _opts(tmp_path: Path, **kw: Any) -> TrainOptions:
    return TrainOptions(out=tmp_path / "run", preset="tiny", explicit=frozenset(kw), **kw)


def test_cp_plans_its_layout_and_config(tmp_path: Path) -> None:
    plan = plan_run(_opts(tmp_path, cp=2), 4)
    assert (plan.layout.cp, plan.config.config.sequence_parallel_size) == (2, 2)
    assert plan.config.config.batch_sizes(2).train_batch_size == 16  # 2 data ranks x 8


@pytest.mark.parametrize(
    ("world", "kw", "message"),
    [
        (2, {"cp": 3}, r"`--cp 3` does not divide `--nproc 2`.*pass `--nproc 3`"),
        (2, {"cp": 2, "seq_len": 1}, r"`--seq-len 1` is shorter than `--cp 2`.*at least 2"),
        (2, {"cp": 2, "moe": True}, r"`--cp` with `--moe` is not built"),
        (4, {"cp": 2, "pp": 2}, r"`--cp` with `--pp` is not built"),
        (4, {"cp": 4, "tp": 2}, r"`--cp 4` x `--tp 2` does not divide `--nproc 4`.*nproc 8"),
    ],
)
def test_bad_cp_fails_at_the_start_naming_the_numbers(
    tmp_path: Path, world: int, kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(TrainError, match=message):
        plan_run(_opts(tmp_path, **kw), world)


def test_a_config_with_another_cp_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text('{"sequence_parallel_size": 2}')
    with pytest.raises(TrainError, match=r"sequence_parallel_size 2.*`--cp 1`.*pass `--cp 2`"):
        plan_run(_opts(tmp_path, config=config), 2)

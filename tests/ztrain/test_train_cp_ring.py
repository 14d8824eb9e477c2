"""`z train --cp N --cp-mode ring`: the GPT with ring attention over `cp` ranks (zig-zag
slices) trains like one process on the whole sequences.

The equivalence: 3 heads, 11-token sequences (zig-zag chunks 3+2 and 3+3 tokens), ZeRO-3 on
2 ranks, 10 steps, the mode taken from the config's `sequence_parallel_mode`, against the
plain GPT with torch's AdamW in one process: per-step losses within rtol 1e-5 and every final
weight within 2e-5 absolute (fp32 summation order and the online-softmax merge; a few % of
one lr 1e-3 step). Slow: cp2 x dp2 on 4 ranks, the same tolerances.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.distributed import run_ranks
from tests.ztrain.test_train_cp import CFG, MB, SEQ, _baseline, _ds_config
from ztrain.gpt import GPT
from ztrain.train_options import TrainError, TrainOptions
from ztrain.train_plan import plan_run

STEPS = 10


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, CFG.vocab_size, (MB, SEQ + 1), generator=g) for _ in range(STEPS)]


def _batches_of(rows: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(17)
    return [torch.randint(0, CFG.vocab_size, (rows, SEQ + 1), generator=g) for _ in range(STEPS)]


def _dp_rank(rank: int, world: int, data: list[torch.Tensor]) -> dict[str, Any]:
    import zcore
    from zcore.zero import GatheredParameters
    from ztrain.gpt_cp import sequence_parallel

    config = {**_ds_config(2, 3), "sequence_parallel_mode": "ring"}
    model = sequence_parallel(GPT(CFG, seed=0))
    engine, *_ = zcore.initialize(model, config=config)
    d, losses = engine.data_rank, []
    for batch in data:  # the two ranks of a sequence read their data rank's rows
        rows = batch[d * MB : (d + 1) * MB]
        _, loss = engine(rows[:, :-1], rows[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with GatheredParameters(list(model.parameters())):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "weights": weights, "data": (engine.world_size, d)}


@pytest.mark.slow(reason="4 gloo ranks x 10 ZeRO-3 steps: 20-50 s on 2 cores")
def test_gpt_at_cp2_dp2_ring_trains_like_one_process() -> None:
    data = _batches_of(2 * MB)
    results = run_ranks(_dp_rank, 4, args=(data,), timeout=300)
    assert [r["data"] for r in results] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    want_losses, want = _baseline(data)
    got = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[2]["losses"], strict=True)]
    assert got == pytest.approx(want_losses, rel=1e-5)  # equal token counts: the mean of means
    for r in results:
        for name, w in want.items():
            torch.testing.assert_close(r["weights"][name], w, rtol=0, atol=2e-5, msg=name)


def _rank(rank: int, world: int, data: list[torch.Tensor]) -> dict[str, Any]:
    import zcore
    from zcore.sequence import SequenceParallelError
    from zcore.zero import GatheredParameters
    from ztrain.gpt_cp import sequence_parallel

    config = {**_ds_config(world, 3), "sequence_parallel_mode": "ring"}
    model = sequence_parallel(GPT(CFG, seed=0))
    engine, *_ = zcore.initialize(model, config=config)
    modes = {m.mode for m in model.modules() if hasattr(m, "chosen")}
    losses = []
    for batch in data:
        _, loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    held = model.slices.layout.index(rank).tolist()
    with GatheredParameters(list(model.parameters())):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:  # a layer built with another mode than the config's
        zcore.initialize(sequence_parallel(GPT(CFG, seed=0), mode="ulysses"), config=config)
        refused = ""
    except SequenceParallelError as err:
        refused = str(err)
    return {"losses": losses, "weights": weights, "modes": modes, "held": held, "no": refused}


def test_gpt_at_cp2_ring_trains_like_one_process_on_the_whole_sequence() -> None:
    data = _batches()
    results = run_ranks(_rank, 2, args=(data,), timeout=120)
    want_losses, want = _baseline(data)
    assert [r["held"] for r in results] == [[0, 1, 2, 9, 10], [3, 4, 5, 6, 7, 8]]
    for r in results:
        assert r["modes"] == {"ring"}
        assert r["losses"] == pytest.approx(want_losses, rel=1e-5)
        for name, w in want.items():
            torch.testing.assert_close(r["weights"][name], w, rtol=0, atol=2e-5, msg=name)
        assert "mode='ulysses'" in r["no"] and "sequence_parallel_mode 'ring'" in r["no"]
    assert want_losses[-1] < want_losses[0]


def _opts(tmp_path: Path, **kw: Any) -> TrainOptions:
    return TrainOptions(out=tmp_path / "run", preset="tiny", explicit=frozenset(kw), **kw)


def test_cp_mode_plans_its_config(tmp_path: Path) -> None:
    plan = plan_run(_opts(tmp_path, cp=2, cp_mode="ring"), 2)
    assert plan.config.config.sequence_parallel_mode == "ring"
    assert plan_run(_opts(tmp_path, cp=2), 2).config.config.sequence_parallel_mode == "ulysses"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"cp": 2, "cp_mode": "rings"}, r"`--cp-mode rings`: pass one of ulysses, ring"),
        ({"cp_mode": "ring"}, r"`--cp-mode ring` splits sequences: add `--cp 2`"),
    ],
)
def test_bad_cp_mode_fails_at_the_start(tmp_path: Path, kw: dict[str, Any], message: str) -> None:
    with pytest.raises(TrainError, match=message):
        plan_run(_opts(tmp_path, **kw), 2)


def test_a_config_with_another_cp_mode_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text('{"sequence_parallel_size": 2, "sequence_parallel_mode": "ring"}')
    with pytest.raises(TrainError, match=r"sequence_parallel_mode 'ring'.*pass `--cp-mode ring`"):
        plan_run(_opts(tmp_path, config=config, cp=2), 2)

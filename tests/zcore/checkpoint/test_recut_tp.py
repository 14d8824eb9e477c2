"""A tensor-parallel checkpoint loads directly at another tp size and continues the run.

Two gloo ranks train ``z train``'s GPT (fused QKV cut by blocks, vocabulary-parallel tied
embedding, row-parallel projections) at layout A, save after 2 steps and train 2 more; a
fresh engine at layout B loads the checkpoint and trains the same 2 steps. ZeRO-2 cuts the
master and Adam's moments across dp, so the load re-cuts them across tp *and* dp: tp 2 x dp 1
<-> tp 1 x dp 2. The resumed losses equal the uninterrupted run's within 1e-5 relative and
every parameter within 2e-5 (:mod:`tests.zcore.checkpoint.common`); a warm-up schedule still
rising at the save checks that the scheduler's position came back too. In fp16 (tp 2 -> tp 1)
the dynamic loss scale doubles every step, so the resumed run steps with the saved scale or
visibly not: the scale loaded equals the one saved, the losses agree within 2e-3 relative
and the parameters within 1e-3 (fp16 sums in another order).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils.distributed import run_ranks
from tests.zcore.checkpoint.common import assert_resumed, gpt_run


@pytest.mark.parametrize(("save_tp", "load_tp"), [(2, 1), (1, 2)])
def test_tp_checkpoint_loads_at_another_tp(tmp_path: Path, save_tp: int, load_tp: int) -> None:
    for rank, out in enumerate(run_ranks(gpt_run, 2, args=(save_tp, load_tp, 2, str(tmp_path)))):
        assert_resumed(out, f"tp {save_tp} -> tp {load_tp}, rank {rank}")


def test_fp16_checkpoint_keeps_its_loss_scale_at_another_tp(tmp_path: Path) -> None:
    for rank, out in enumerate(run_ranks(gpt_run, 2, args=(2, 1, 2, str(tmp_path), True))):
        assert_resumed(out, f"fp16 tp 2 -> tp 1, rank {rank}", rtol=2e-3, atol=1e-3)

"""``z train``'s GPT at tp 2 trains as the plain GPT does on one process.

Two ranks cut every block (fused q/k/v by heads, MLP, vocabulary-parallel embedding, tied
head, vocabulary-parallel cross-entropy) and train 10 AdamW steps with clipping at a norm
below the gradient's, so a norm counted wrong (tp shards not summed, replicated LayerNorms
counted twice) changes every update. Losses must match to ``LOSS_RTOL`` relative, the
clipped norms to 1e-4 and every gathered parameter to ``PARAM_ATOL`` (tests/zcore/tensor/
common.py); both tp ranks must hold the same replicated parameters. With sequence
parallelism (norms and residuals on T/tp positions) at ZeRO stages 1 and 3 too.
"""

from __future__ import annotations

import pytest
import torch

from tests.utils.distributed import run_ranks
from tests.zcore.tensor.common import assert_same_run, make_gpt, train
from zcore.comm import MeshSpec

STEPS = 10


def _run(rank: int, world: int, tp: int, stage: int, tie: bool, sp: bool) -> dict:
    spec = MeshSpec.resolve(world, tp=tp)
    return train(make_gpt(tie), spec, stage, STEPS, mb=2, dp=1, sequence_parallel=sp)


SLOW = pytest.mark.slow(reason="the default cases cover the same path")


@pytest.mark.parametrize(
    ("tie", "sp", "stage"),
    [
        (True, False, 1),
        (True, True, 3),
        pytest.param(False, False, 1, marks=SLOW),
        pytest.param(True, True, 1, marks=SLOW),
    ],
)
def test_gpt_tp2_equals_single_process(tie: bool, sp: bool, stage: int) -> None:
    (ref,) = run_ranks(_run, 1, args=(1, 1, tie, False))
    got = run_ranks(_run, 2, args=(2, stage, tie, sp))
    for rank, out in enumerate(got):
        assert_same_run(out, ref, f"tp rank {rank}")
    assert got[0]["losses"] == got[1]["losses"]
    # replicated parameters (LayerNorms, positions, row biases) stay identical across tp
    assert all(torch.equal(v, got[1]["params"][k]) for k, v in got[0]["params"].items())

"""A ``PipelineEngine`` at pp 1 on several ranks (dp 2): every stage is each rank's own, so
``train_batch``/``eval_batch`` run the micro-batches through the stages without torch's
pipelining (whose ``PipelineStage`` needs a ``pp`` group of more than one rank) and train as
one process does: 10 steps, the tolerances of :mod:`tests.zcore.pipe.test_pipe_train`."""

from __future__ import annotations

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.pipe.common import config, local_params, make_pipe, micro_batches, train
from tests.zcore.pipe.test_pipe_train import GAS, MB, STEPS, _check

STAGES = (1, 3)


def _run(rank: int, world: int) -> dict[int, tuple]:
    out = {}
    for stage in STAGES:
        engine, *_ = zcore.initialize(make_pipe(1), config=config(stage, mb=MB, gas=GAS))
        assert engine.mesh.spec.pp == 1 and engine.world_size == world
        losses = train(engine, STEPS, MB, GAS)
        held_out = iter(micro_batches(STEPS, engine.world_size, MB, GAS)[engine.data_rank])
        losses.append(float(engine.eval_batch(held_out)))
        out[stage] = (losses, local_params(engine))
        engine.destroy()
    return out


def test_pp1_dp2_trains_like_one_process() -> None:
    outs = run_ranks(_run, 2, timeout=300)
    for stage in STAGES:
        _check([o[stage] for o in outs], dp=2)

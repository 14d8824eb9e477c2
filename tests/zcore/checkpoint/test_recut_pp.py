"""A pipeline checkpoint loads directly at another number of stages and continues the run.

The pipeline tests' layer stack (embedding tied to the output head, 4 blocks; ZeRO-1) is
trained at pp 2 on two gloo ranks or at pp 1 on one, saved after 2 steps and trained 2 more
(the uninterrupted run, saved again at the end); a fresh engine at the other layout loads
the first checkpoint: layer ``i``'s parameters move to whichever stage now holds it (the
tie's two copies become one, or one becomes two) with their master weights and Adam's
moments. It trains the same 2 steps and saves: its losses equal the uninterrupted run's
within 1e-5 relative and ``consolidate`` of both end checkpoints (one tensor per name from
either layout) agrees within 2e-5 absolute. pp 2 -> pp 1 also loads the checkpoint as the
code before the parameter table wrote it (:mod:`tests.zcore.checkpoint.test_recut_old`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.checkpoint.common import LOSS_RTOL, PARAM_ATOL, SAVE_AT, STEPS, WARMUP
from tests.zcore.pipe.common import config, make_pipe, micro_batches
from zcore.checkpoint import consolidate

GAS, ROWS = 2, 4  # micro-batches per step and rows per step, at every layout


def pipe_engine(world: int, pp: int, seed: int, stage: int = 1) -> Any:
    dp = world // pp
    cfg = config(stage, mb=ROWS // (GAS * dp), gas=GAS, scheduler=WARMUP)
    return zcore.initialize(make_pipe(pp, base_seed=seed), config=cfg)[0]


def pipe_steps(engine: Any, start: int, end: int) -> list[float]:
    dp, d = engine.world_size, engine.data_rank
    mb = ROWS // (GAS * dp)
    return [
        float(engine.train_batch(iter(micro_batches(s, dp, mb, GAS)[d]))) for s in range(start, end)
    ]


def _save(rank: int, world: int, pp: int, root: str, old: bool) -> list[float]:
    import torch.distributed as dist

    from tests.zcore.checkpoint.test_recut_old import strip

    engine = pipe_engine(world, pp, 1234)
    pipe_steps(engine, 0, SAVE_AT)
    engine.save_checkpoint(root, tag="a")
    straight = pipe_steps(engine, SAVE_AT, STEPS)
    engine.save_checkpoint(root, tag="end")
    engine.destroy()
    if old and rank == 0:
        strip(Path(root), "a", "old")
    if dist.is_initialized():
        dist.barrier()
    return straight


def _load(rank: int, world: int, pp: int, root: str, tags: list[str]) -> dict[str, Any]:
    out = {}
    for tag in tags:
        engine = pipe_engine(world, pp, 99)
        engine.load_checkpoint(root, tag=tag)
        assert engine.global_steps == SAVE_AT
        out[tag] = pipe_steps(engine, SAVE_AT, STEPS)
        engine.save_checkpoint(root, tag=f"end-{tag}")
        engine.destroy()
    return out


@pytest.mark.parametrize(("save_pp", "load_pp"), [(2, 1), (1, 2)])
def test_pipeline_checkpoint_loads_at_another_pp(
    tmp_path: Path, save_pp: int, load_pp: int
) -> None:
    root = str(tmp_path)
    old = save_pp == 2
    straight = run_ranks(_save, save_pp, args=(save_pp, root, old))[0]
    tags = ["a", "old"] if old else ["a"]
    ref = consolidate(root, "end")
    for rank, out in enumerate(run_ranks(_load, load_pp, args=(load_pp, root, tags))):
        for tag in tags:
            torch.testing.assert_close(
                torch.tensor(out[tag]), torch.tensor(straight), rtol=LOSS_RTOL, atol=0
            )
            got = consolidate(root, f"end-{tag}")
            assert got.keys() == ref.keys(), (rank, tag)
            for name, value in ref.items():
                torch.testing.assert_close(got[name], value, rtol=0, atol=PARAM_ATOL, msg=name)


class Tagged(torch.nn.Module):
    """The identity, with a persistent buffer a load must bring back."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("tag", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _tagged(stages: int) -> Any:
    from tests.zcore.pipe.common import DIM, VOCAB, Block, loss_fn
    from zcore.pipe import LayerSpec, PipelineModule

    specs = [
        LayerSpec(torch.nn.Embedding, VOCAB, DIM),
        LayerSpec(Block),
        LayerSpec(Tagged),  # uniform: layers 2-4 are the second stage
        LayerSpec(torch.nn.LayerNorm, DIM),
        LayerSpec(torch.nn.Linear, DIM, VOCAB),
    ]
    return PipelineModule(specs, stages, loss_fn=loss_fn, partition_method="uniform")


def _save_tagged(rank: int, world: int, root: str) -> None:
    engine = zcore.initialize(_tagged(2), config=config(1, mb=1, gas=2))[0]
    for buf in engine.module.buffers():
        buf.copy_(torch.tensor([7.0, 8.0, 9.0]))  # only the second stage holds one
    engine.save_checkpoint(root, tag="t")
    engine.destroy()


def _load_tagged(rank: int, world: int, root: str) -> list[float]:
    engine = zcore.initialize(_tagged(1), config=config(1, mb=1, gas=2))[0]
    engine.load_checkpoint(root, tag="t")
    return dict(engine.module.named_buffers())["layers.2.tag"].tolist()


def test_a_later_stages_buffers_load_at_another_pp(tmp_path: Path) -> None:
    run_ranks(_save_tagged, 2, args=(str(tmp_path),))
    assert run_ranks(_load_tagged, 1, args=(str(tmp_path),)) == [[7.0, 8.0, 9.0]]
    assert consolidate(str(tmp_path), "t")["layers.2.tag"].tolist() == [7.0, 8.0, 9.0]

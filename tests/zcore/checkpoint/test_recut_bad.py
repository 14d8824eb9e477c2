"""A checkpoint that does not fit the model it is loaded into is refused by name and number,
and the engine is left exactly as it was; a layout that cannot hold the model fails at start.

Two gloo ranks save the pipeline tests' layer stack at pp 2; loads at pp 1 x dp 2 into a
model with another block count (parameters the checkpoint lacks) and into one with a wider
vocabulary (the tied embedding's rows, a dimension no layout cuts) must raise
:class:`CheckpointError` naming the parameters, both shapes and the fix, and leave every
parameter, master weight and counter as it was, so training goes on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.checkpoint.test_recut_pp import pipe_engine, pipe_steps
from tests.zcore.pipe.common import DIM, Block, config, head, loss_fn
from zcore.checkpoint import CheckpointError
from zcore.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zcore.pipe.partition import PartitionError


def _stack(vocab: int, blocks: int) -> PipelineModule:
    specs: list[Any] = [TiedLayerSpec("embed", nn.Embedding, vocab, DIM)]
    specs += [LayerSpec(Block) for _ in range(blocks)]
    specs += [
        LayerSpec(nn.LayerNorm, DIM),
        TiedLayerSpec("embed", nn.Embedding, vocab, DIM, forward_fn=head),
    ]
    return PipelineModule(specs, num_stages=1, loss_fn=loss_fn, seed_layers=True)


def _snapshot(engine: Any) -> list[torch.Tensor]:
    params = [p.detach().clone() for p in engine.module.parameters()]
    return params + [m.detach().clone() for m in engine.zopt.master]


def _attempt(model: PipelineModule, root: str) -> dict[str, Any]:
    engine, *_ = zcore.initialize(model, config=config(1, mb=1, gas=2))
    before, steps = _snapshot(engine), engine.global_steps
    try:
        engine.load_checkpoint(root, tag="a")
        message = ""
    except CheckpointError as err:
        message = str(err)
    after = _snapshot(engine)
    same = steps == engine.global_steps and all(
        torch.equal(a, b) for a, b in zip(before, after, strict=True)
    )
    engine.destroy()
    return {"message": message, "unchanged": same}


def _bad_loads(rank: int, world: int, root: str) -> dict[str, Any]:
    first = pipe_engine(world, 2, 1234)
    pipe_steps(first, 0, 2)
    first.save_checkpoint(root, tag="a")
    first.destroy()
    return {"blocks": _attempt(_stack(61, 5), root), "vocab": _attempt(_stack(67, 4), root)}


def test_a_checkpoint_of_another_model_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    for out in run_ranks(_bad_loads, 2, args=(str(tmp_path),)):
        blocks, vocab = out["blocks"], out["vocab"]
        assert "has no values for" in blocks["message"], blocks["message"]
        assert "layers.5.fc.weight" in blocks["message"] or "layers.5" in blocks["message"]
        assert "model it was saved from" in blocks["message"]
        assert blocks["unchanged"]
        assert (
            "`tied.embed.weight` was saved with shape [61, 24], the model's is [67, 24]"
            in (vocab["message"])
        ), vocab["message"]
        assert "consolidate" in vocab["message"]
        assert vocab["unchanged"]


def test_more_stages_than_the_checkpoints_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack above has 7 layers: 8 stages cannot hold it, whatever the checkpoint."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(PartitionError, match=r"has 7 layers but 8 stages.*at most 7 stages"):
        PipelineModule([s for s in _stack(61, 4).specs], num_stages=8, loss_fn=loss_fn)

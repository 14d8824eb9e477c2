"""A pipelined model that names its parameters as the plain model does shares checkpoints
with it, at any layout: ``checkpoint_names()`` (:mod:`zcore.checkpoint.names`).

The pipeline tests' layer stack (tied embedding, 4 blocks, LayerNorm, tied head) is the
zero tests' ``TinyLM`` of 4 blocks layer for layer; its ``checkpoint_names()`` maps
``tied.embed.weight`` -> ``emb.weight``, ``layers.<i>.…`` -> ``blocks.<i-1>.…`` and
``layers.5.…`` -> ``ln_f.…``. On two gloo ranks it trains at pp 2 (ZeRO-1), saves after 2
steps and trains 2 more; a plain ``TinyLM`` engine at dp 2 loads the checkpoint and trains
the same 2 steps: losses within 1e-5 relative, and ``consolidate`` of both end checkpoints
within 2e-5 absolute, under the plain model's names (``TinyLM.load_state_dict`` takes the
plain run's, ``strict=True``). Back the other way, the pipeline at pp 2 loads the plain
model's checkpoint and holds its values; so does a plain model whose embedding is frozen
now but was trained in the checkpoint (its value comes from the master weights).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.checkpoint.common import LOSS_RTOL, PARAM_ATOL, SAVE_AT, STEPS, WARMUP
from tests.zcore.checkpoint.test_recut_pp import GAS, ROWS, pipe_steps
from tests.zcore.pipe.common import config as pipe_config
from tests.zcore.pipe.common import make_pipe
from tests.zcore.zero.common import TinyLM, train
from tests.zcore.zero.common import config as plain_config
from zcore.checkpoint import consolidate

BLOCKS = 4


def plain_name(name: str) -> str:
    """The stack's parameter ``name`` as ``TinyLM`` names it."""
    if name.startswith("tied.embed."):
        return "emb." + name.removeprefix("tied.embed.")
    idx, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", name).groups()  # type: ignore[union-attr]
    return f"blocks.{int(idx) - 1}.{rest}" if int(idx) <= BLOCKS else f"ln_f.{rest}"


def _pipe(world: int, seed: int) -> Any:
    model = make_pipe(2, BLOCKS, base_seed=seed)
    model.checkpoint_names = lambda: {n: plain_name(n) for n, _ in model.named_parameters()}
    cfg = pipe_config(1, mb=ROWS // GAS, gas=GAS, scheduler=WARMUP)
    return zcore.initialize(model, config=cfg)[0]


def _run(rank: int, world: int, root: str) -> dict[str, Any]:
    first = _pipe(world, 1234)
    pipe_steps(first, 0, SAVE_AT)
    first.save_checkpoint(root, tag="a")
    straight = pipe_steps(first, SAVE_AT, STEPS)
    first.save_checkpoint(root, tag="end")
    first.destroy()

    torch.manual_seed(7)
    cfg = plain_config(1, mb=ROWS // (GAS * world), gas=GAS, clip=0.0, scheduler=WARMUP)
    plain, *_ = zcore.initialize(TinyLM(BLOCKS), config=cfg)
    plain.load_checkpoint(root, tag="a")
    steps = plain.global_steps
    resumed = train(plain, STEPS - SAVE_AT, start=SAVE_AT)
    plain.save_checkpoint(root, tag="end-plain")
    plain.destroy()

    back = _pipe(world, 99)
    back.load_checkpoint(root, tag="end-plain")
    held = {plain_name(n): p.detach().clone() for n, p in back.module.named_parameters()}
    back.destroy()

    torch.manual_seed(9)
    frozen = TinyLM(BLOCKS)
    frozen.emb.weight.requires_grad_(False)  # trained in the checkpoint, frozen now
    engine, *_ = zcore.initialize(frozen, config=cfg)
    engine.load_checkpoint(root, tag="end-plain")
    held_frozen = frozen.emb.weight.detach().clone()
    engine.destroy()
    return {
        "straight": straight,
        "resumed": resumed,
        "steps": steps,
        "held": held,
        "frozen": held_frozen,
    }


def test_a_pipeline_and_its_plain_model_share_checkpoints(tmp_path: Path) -> None:
    root = str(tmp_path)
    outs = run_ranks(_run, 2, args=(root,))
    ref, got = consolidate(root, "end"), consolidate(root, "end-plain")
    assert set(got) == set(ref) | {"head.weight"}  # the plain model's name for the tie too
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=PARAM_ATOL, msg=name)
    TinyLM(BLOCKS).load_state_dict(got, strict=True)
    for out in outs:
        assert out["steps"] == SAVE_AT
        torch.testing.assert_close(
            torch.tensor(out["resumed"]), torch.tensor(out["straight"]), rtol=LOSS_RTOL, atol=0
        )
        for name, value in out["held"].items():
            assert torch.equal(value, got[name]), name
        assert torch.equal(out["frozen"], got["emb.weight"])

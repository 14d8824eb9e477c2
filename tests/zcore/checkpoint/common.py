"""Runs for the checkpoint re-cut tests: train at one layout, save, load at another.

The uninterrupted run trains at layout A for ``SAVE_AT`` steps, saves, and trains on to
``STEPS``; a fresh engine (another seed) at layout B loads the checkpoint and trains the
same steps. The global batch is the same rows at every layout (each data rank takes its
share), so the losses compare directly. A warm-up LR schedule still rising at the save
makes a resumed run that lost the scheduler's position differ.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import zcore
from tests.zcore.tensor.common import GPT_SHAPE, global_batch
from tests.zcore.zero.common import config
from zcore.comm import MeshSpec
from zcore.tensor import gather_full_state_dict, parallelize
from ztrain.gpt import GPT, GPTConfig

SAVE_AT, STEPS = 2, 4
GLOBAL = 4
"""Sequences per optimizer step, at every layout."""
LOSS_RTOL = 1e-5
"""A resumed step's loss against the uninterrupted run's (fp32: another layout changes only
the order of sums)."""
PARAM_ATOL = 2e-5
"""Every parameter element at the end (AdamW, lr up to 3e-3)."""
WARMUP = {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 6}}


def mean_over_ranks(value: float) -> float:
    """The mean of ``value`` over every rank (each data rank's share of the batch)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1}
"""A dynamic loss scale that doubles every step without overflow: a resumed run that lost
the scaler's state steps with another scale."""


def gpt_engine(world: int, tp: int, stage: int, seed: int, fp16: bool = False, **shape: Any) -> Any:
    """``z train``'s GPT at ``tp`` x (world / tp) data ranks (fp32, or fp16 with :data:`FP16`)."""
    spec = MeshSpec.resolve(world, tp=tp)
    model = GPT(GPTConfig(**{**GPT_SHAPE, **shape}), seed=seed)
    if tp > 1:
        model = parallelize(model, spec)
    cfg = config(stage, mb=GLOBAL * tp // world, gas=1, clip=0.05, scheduler=WARMUP)
    if fp16:
        cfg["fp16"] = FP16
    return zcore.initialize(model, config=cfg, mesh=spec)[0]


def gpt_steps(engine: Any, start: int, end: int) -> list[float]:
    """Steps ``start .. end - 1``; each step's loss over the global batch."""
    out = []
    mb = GLOBAL // engine.world_size
    for step in range(start, end):
        x, y = global_batch(step, GLOBAL)
        lo = engine.data_rank * mb
        _, loss = engine(x[lo : lo + mb], y[lo : lo + mb])
        engine.backward(loss)
        engine.step()
        out.append(mean_over_ranks(float(loss.detach())))
    return out


def gpt_run(
    rank: int, world: int, save_tp: int, load_tp: int, stage: int, root: str, fp16: bool = False
) -> dict:
    """The uninterrupted GPT run at tp ``save_tp`` and the one resumed at ``load_tp``."""
    first = gpt_engine(world, save_tp, stage, seed=0, fp16=fp16)
    gpt_steps(first, 0, SAVE_AT)
    first.save_checkpoint(root, tag="a")
    scale = first.loss_scale
    straight = gpt_steps(first, SAVE_AT, STEPS)
    ref = gather_full_state_dict(first.module)
    first.destroy()
    again = gpt_engine(world, load_tp, stage, seed=7, fp16=fp16)
    again.load_checkpoint(root, tag="a")
    steps, scales = again.global_steps, (scale, again.loss_scale)
    resumed = gpt_steps(again, SAVE_AT, STEPS)
    got = gather_full_state_dict(again.module)
    again.destroy()
    worst = max(float((got[k] - v).abs().max()) for k, v in ref.items())
    return {
        "straight": straight,
        "resumed": resumed,
        "steps": steps,
        "worst": worst,
        "scales": scales,
    }


def assert_resumed(
    out: dict[str, Any], what: str, rtol: float = LOSS_RTOL, atol: float = PARAM_ATOL
) -> None:
    assert out["steps"] == SAVE_AT, what
    saved, loaded = out["scales"]
    assert saved == loaded, (what, out["scales"])
    torch.testing.assert_close(
        torch.tensor(out["resumed"]),
        torch.tensor(out["straight"]),
        rtol=rtol,
        atol=0,
        msg=lambda m: f"{what}: {m}",
    )
    assert out["worst"] <= atol, (what, out["worst"])

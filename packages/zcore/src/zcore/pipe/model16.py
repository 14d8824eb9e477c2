"""``save_16bit_model`` under a pipeline: one ``state_dict`` holding every stage's layers.

Each pipeline rank holds only its stages' layers, so the plain engine's save (rank 0
writes its own ``module.state_dict()``) would write the first stage alone. Here every rank
takes its full values (gathered over ``dp`` at ZeRO-3), the first data-parallel rank of
each stage writes them to a part file beside the target, and global rank 0 joins the
parts into ``save_dir/save_filename`` (a tie's copies are equal: one entry per name) and
removes them. The directory must be shared by the ranks, as checkpoints' is.
"""

from __future__ import annotations

from pathlib import Path

import torch

from zcore.checkpoint.files import save_torch
from zcore.checkpoint.parts import CheckpointParts
from zcore.comm import Comm


def save_pipeline_16bit(
    parts: CheckpointParts, pp: Comm, writer: bool, save_dir: str, save_filename: str
) -> bool:
    """Collective over the job. ``writer``: this rank writes its stage's part (the first
    data-parallel rank of its pipeline coordinate)."""
    state = parts.model.full_state_dict()  # collective over dp at stage 3
    out = Path(save_dir)
    part = out / f".{save_filename}.pp{pp.rank:03d}"
    world = parts.place.comm
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        save_torch(state, part)
    world.barrier("barrier(save_16bit_model: stage parts written)")
    if parts.place.rank == 0:
        joined: dict[str, torch.Tensor] = {}
        names = [out / f".{save_filename}.pp{r:03d}" for r in range(pp.size)]
        for name in names:
            joined.update(torch.load(name, map_location="cpu", weights_only=True))
        save_torch(joined, out / save_filename)
        for name in names:
            name.unlink()
    world.barrier("barrier(save_16bit_model)")
    return True

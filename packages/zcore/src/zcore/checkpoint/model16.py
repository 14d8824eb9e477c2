"""The whole model in its training dtype as one plain ``state_dict`` (``save_16bit_model``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from zcore.checkpoint.files import save_torch

if TYPE_CHECKING:
    from zcore.checkpoint.parts import CheckpointParts


def save_16bit_model(parts: CheckpointParts, save_dir: str, save_filename: str) -> bool:
    """Rank 0 writes ``save_dir/save_filename`` (see :meth:`ZEngine.save_16bit_model`);
    collective (stage 3 gathers every parameter)."""
    state = parts.model.full_state_dict()
    if parts.place.rank == 0:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        save_torch(state, Path(save_dir) / save_filename)
    parts.place.comm.barrier("barrier(save_16bit_model)")
    return True

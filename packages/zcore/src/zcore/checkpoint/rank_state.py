"""Per-rank state a checkpoint keeps besides the shards: error feedback and local drift.

A communicating optimizer (1-bit Adam's worker and server errors, 0/1 Adam's momentum
accumulator) and compressed collectives (ZeRO++ LoCo) keep state that differs on every
rank and is not part of any partition. DeepSpeed resets it on load; we save it, one file
per global rank (``comm_rank_NNNNN.pt``), so that save, load, continue equals the
uninterrupted run. Loaded on another world size or another mesh layout it cannot be re-cut
(each rank's error is its own): every rank then starts it afresh, as DeepSpeed always does,
and says so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zcore.checkpoint.files import CheckpointError, load_torch, save_torch

if TYPE_CHECKING:
    from zcore.checkpoint.parts import RankPlace

log = logging.getLogger(__name__)


def comm_file(rank: int) -> str:
    return f"comm_rank_{rank:05d}.pt"


def save_rank_state(rank: int, state: dict[str, Any] | None, tmp: Path) -> None:
    """Write global rank ``rank``'s state (the per-rank part's ``state_dict``), if any."""
    if state is not None:
        save_torch(state, tmp / comm_file(rank))


def read_rank_state(place: RankPlace, path: Path, manifest: dict[str, Any]) -> dict | None:
    """This rank's saved state, or None when the checkpoint has none that fits this job."""
    saved_world = manifest.get("comm_state_world")
    if saved_world is None:
        return None
    saved_mesh = manifest.get("mesh")
    if int(saved_world) != place.world or (saved_mesh is not None and saved_mesh != place.mesh):
        if place.rank == 0:
            log.warning(
                "checkpoint `%s` keeps per-rank error feedback for %s ranks on mesh %s and "
                "this job has %d on %s: it starts from zero (as after a DeepSpeed load)",
                path,
                saved_world,
                saved_mesh,
                place.world,
                place.mesh,
            )
        return None
    file = path / comm_file(place.rank)
    if not file.exists():
        raise CheckpointError(
            f"`{file}` is missing: the manifest says every one of {saved_world} ranks saved "
            "its error-feedback state; the checkpoint is damaged: load another tag"
        )
    state = load_torch(file)
    if not isinstance(state, dict) or "optimizer" not in state or "collectives" not in state:
        raise CheckpointError(f"`{file}` is not a per-rank state file; load another tag")
    return state

"""Per-rank state a checkpoint keeps besides the shards: error feedback and local drift.

A communicating optimizer (1-bit Adam's worker and server errors, 0/1 Adam's momentum
accumulator) and compressed collectives (ZeRO++ LoCo) keep state that differs on every
rank and is not part of any partition. DeepSpeed resets it on load; we save it, one file
per global rank (``comm_rank_NNNNN.pt``), so that save, load, continue equals the
uninterrupted run. Loaded on another world size it cannot be re-cut (each rank's error is
its own): every rank then starts it afresh, as DeepSpeed always does, and says so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zcore.checkpoint.files import CheckpointError, load_torch, save_torch

if TYPE_CHECKING:
    from zcore.engine import ZEngine

log = logging.getLogger(__name__)


def comm_file(rank: int) -> str:
    return f"comm_rank_{rank:05d}.pt"


def rank_state(engine: ZEngine) -> dict[str, Any] | None:
    """This rank's state to save, or None when the engine keeps none."""
    talker = engine.zopt.communicator
    collectives = engine.collectives.state_dict()
    if talker is None and not collectives:
        return None
    return {
        "world": engine.mesh.spec.world,
        "optimizer": talker.comm_state_dict() if talker is not None else None,
        "collectives": collectives,
    }


def save_rank_state(engine: ZEngine, state: dict[str, Any] | None, tmp: Path) -> None:
    if state is not None:
        save_torch(state, tmp / comm_file(engine.rank))


def read_rank_state(engine: ZEngine, path: Path, manifest: dict[str, Any]) -> dict | None:
    """This rank's saved state, or None when the checkpoint has none that fits this job."""
    saved_world = manifest.get("comm_state_world")
    if saved_world is None:
        return None
    if int(saved_world) != engine.mesh.spec.world:
        if engine.rank == 0:
            log.warning(
                "checkpoint `%s` keeps per-rank error feedback for %s ranks and this job has "
                "%d: it starts from zero (as after a DeepSpeed load)",
                path,
                saved_world,
                engine.mesh.spec.world,
            )
        return None
    file = path / comm_file(engine.rank)
    if not file.exists():
        raise CheckpointError(
            f"`{file}` is missing: the manifest says every one of {saved_world} ranks saved "
            "its error-feedback state; the checkpoint is damaged: load another tag"
        )
    state = load_torch(file)
    if not isinstance(state, dict) or "optimizer" not in state or "collectives" not in state:
        raise CheckpointError(f"`{file}` is not a per-rank state file; load another tag")
    return state


def apply_rank_state(engine: ZEngine, state: dict[str, Any] | None) -> None:
    """Hand the state back (None: start it afresh)."""
    talker = engine.zopt.communicator
    if talker is not None:
        talker.load_comm_state_dict(None if state is None else state["optimizer"])
    if state is not None and state["collectives"]:
        engine.collectives.load_state_dict(state["collectives"])

"""The whole model in its training dtype as one plain ``state_dict`` (``save_16bit_model``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from zcore.checkpoint.files import save_torch

if TYPE_CHECKING:
    from zcore.engine import ZEngine


def save_16bit_model(engine: ZEngine, save_dir: str, save_filename: str) -> bool:
    """Rank 0 writes ``save_dir/save_filename`` (see :meth:`ZEngine.save_16bit_model`)."""
    from zcore.zero import GatheredParameters

    zc = engine.config.zero_optimization
    if engine.stage == 3 and not zc.stage3_gather_16bit_weights_on_model_save:
        raise ValueError(
            "save_16bit_model at ZeRO stage 3 gathers every parameter; set "
            "`zero_optimization.stage3_gather_16bit_weights_on_model_save: true`, or use "
            "save_checkpoint + `z checkpoint consolidate`"
        )
    with GatheredParameters(list(engine.module.parameters()), enabled=engine.stage3 is not None):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    if engine.rank == 0:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        save_torch(state, Path(save_dir) / save_filename)
    engine.world_comm.barrier("barrier(save_16bit_model)")
    return True

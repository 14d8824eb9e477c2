"""The ``tensor_parallel`` config block: DeepSpeed's AutoTP training key ``autotp_size``.

With ``"tensor_parallel": {"autotp_size": T}`` the mesh gets ``tp = T`` (the world size must
be a multiple of ``T``; ``dp`` is what is left) and ``zcore.initialize`` cuts the model by
the plan its config chooses (:func:`zcore.tensor.parallelize`) unless it is cut already.
DeepSpeed's other keys of the block (``partition_config``, ``preset_model``, ...) are not
honoured and so are refused by name.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from zcore.config._base import Int, ZModel


class TensorParallelConfig(ZModel):
    """``tensor_parallel``: how many ranks each layer is cut over."""

    autotp_size: Int = Field(1, ge=1)
    """Tensor-parallel ranks: the mesh's ``tp`` axis (1: no tensor parallelism)."""


def config_tp(config: Any) -> int:
    """The ``tp`` size a :class:`~zcore.config.ZConfig` asks for (1 when it has no block)."""
    block = config.extension("tensor_parallel") if hasattr(config, "extension") else None
    return int(block.autotp_size) if block is not None else 1

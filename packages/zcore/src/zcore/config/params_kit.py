"""What a package needs to declare its own ``optimizer.params`` model, without importing
pydantic itself (ARCHITECTURE.md: only zcore depends on it).

Subclass :class:`~zcore.config.OptimizerParams` and type fields with these::

    from zcore.config import OptimizerParams
    from zcore.config.params_kit import Field, Float, Int, field_validator

    class OneBitAdamParams(OptimizerParams):
        lr: Float = Field(1e-3, ge=0)
        freeze_step: Int = Field(100000, ge=0)

``Float``/``Int`` reject booleans and strings (as every zcore field does); an unknown key
is an error naming the closest known one (:class:`~zcore.config._base.ZModel`).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from zcore.config._base import Bool, Float, Int

__all__ = ["Bool", "Field", "Float", "Int", "field_validator"]

"""Mixed-precision blocks: ``fp16`` (with its dynamic loss scaler), ``bf16`` and
``data_types``, as DeepSpeed names them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from zcore.config._base import Bool, Float, Int, ZModel

#: Names DeepSpeed uses for floating-point dtypes in a config.
DtypeName = Literal["fp32", "fp16", "bf16"]


class FP16Config(ZModel):
    """``fp16``: train in float16 with fp32 master weights and a loss scaler."""

    enabled: Bool = False
    """Run forward and backward in float16."""
    loss_scale: Float = Field(0.0, ge=0)
    """A fixed loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: Int = Field(16, ge=0)
    """The dynamic scaler starts at ``2 ** initial_scale_power``."""
    loss_scale_window: Int = Field(1000, ge=1)
    """Steps without overflow before the dynamic scale doubles."""
    hysteresis: Int = Field(2, ge=1)
    """Overflows tolerated before the dynamic scale halves."""
    consecutive_hysteresis: Bool = False
    """Refill the hysteresis budget after every step without overflow."""
    min_loss_scale: Float = Field(1.0, gt=0)
    """The dynamic scale never drops below this."""

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the loss scale adapts to overflows (``loss_scale`` is 0)."""
        return self.loss_scale == 0


class BF16Config(ZModel):
    """``bf16`` (DeepSpeed also reads ``bfloat16``): train in bfloat16 with fp32 master weights."""

    enabled: Bool = False
    """Run forward and backward in bfloat16."""


class DataTypesConfig(ZModel):
    """``data_types``: dtypes of buffers other than the parameters'."""

    grad_accum_dtype: DtypeName | None = None
    """Dtype gradients accumulate in across micro-batches; None uses the training dtype."""


def precision_of(fp16: FP16Config, bf16: BF16Config) -> DtypeName:
    """The training dtype selected by the two blocks (they are never both enabled)."""
    if fp16.enabled:
        return "fp16"
    if bf16.enabled:
        return "bf16"
    return "fp32"

"""``scheduler``: DeepSpeed's learning-rate schedules, ``{"type": ..., "params": {...}}``.

``type`` is matched case-insensitively and stored as ``WarmupLR``,
``WarmupDecayLR``, ``WarmupCosineLR`` or ``OneCycle``; ``params.model_dump()``
gives the schedule's keyword arguments with DeepSpeed's names.

Everything the schedules would refuse is refused here, so that ``zcore.initialize``
fails before it touches the model. What DeepSpeed runs with a warning (a
``total_num_steps`` not above ``warmup_num_steps``) runs here too, with the same warning.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Tag

from zcore.config._base import Bool, Float, Int, TypedBlock, ZModel, empty_block, type_discriminator

#: The scheduler types zstack provides, in their canonical spelling.
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")

WarmupType = Literal["log", "linear"]


class WarmupLRParams(ZModel):
    """``params`` of ``WarmupLR``: warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold."""

    warmup_min_lr: Float = Field(0.0, ge=0)
    """Learning rate of the first two optimizer steps (iterations -1 and 0)."""
    warmup_max_lr: Float | None = Field(None, ge=0)
    """Learning rate at the end of warmup; None (as DeepSpeed) takes the optimizer's lr."""
    warmup_num_steps: Int = Field(1000, ge=1)
    """Steps of warmup (1 counts as 2, as in DeepSpeed)."""
    warmup_type: WarmupType = "log"
    """Shape of the warmup curve."""
    last_batch_iteration: Int = Field(-1, ge=-1)
    """Step to resume from; -1 starts a new schedule."""


class WarmupDecayLRParams(WarmupLRParams):
    """``params`` of ``WarmupDecayLR``: WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    warmup_max_lr: Float = Field(1e-3, ge=0)
    """Learning rate at the end of warmup (DeepSpeed's default here is 0.001)."""
    total_num_steps: Int = Field(ge=1)
    """Step at which the decay reaches ``warmup_min_lr``."""


class WarmupCosineLRParams(ZModel):
    """``params`` of ``WarmupCosineLR``: warmup as a ratio of the optimizer's lr, then cosine decay."""

    total_num_steps: Int = Field(ge=1)
    """Steps of the whole schedule."""
    warmup_min_ratio: Float = Field(0.0, ge=0, le=1)
    """Fraction of the optimizer's lr at iteration 0 (the first step runs at lr 0, as DeepSpeed)."""
    warmup_num_steps: Int = Field(1000, ge=1)
    """Steps of warmup (1 counts as 2, as in DeepSpeed)."""
    cos_min_ratio: Float = Field(1e-4, ge=0, le=1)
    """Fraction of the optimizer's lr at the end of the cosine."""
    warmup_type: WarmupType = "log"
    """Shape of the warmup curve."""
    last_batch_iteration: Int = Field(-1, ge=-1)
    """Step to resume from; -1 starts a new schedule."""


class OneCycleParams(ZModel):
    """``params`` of ``OneCycle``: lr up then down between two bounds (momentum the other way),
    then decay."""

    cycle_min_lr: Float = Field(ge=0)
    """Learning rate at the start and end of the cycle."""
    cycle_max_lr: Float = Field(ge=0)
    """Learning rate at the peak of the cycle."""
    decay_lr_rate: Float = Field(0.0, ge=0)
    """Learning-rate decay rate after the cycle."""
    cycle_first_step_size: Int = Field(2000, ge=1)
    """Steps of the increasing half of the cycle."""
    cycle_second_step_size: Int | None = Field(None, ge=0)
    """Steps of the decreasing half; None means the same as the first."""
    cycle_first_stair_count: Int = Field(0, ge=0)
    """Stairs in the first half; 0 means a continuous ramp."""
    cycle_second_stair_count: Int | None = Field(None, ge=0)
    """Stairs in the second half; None means the same as the first."""
    decay_step_size: Int = Field(0, ge=0)
    """Steps between decays after the cycle; 0 means no decay."""
    cycle_momentum: Bool = True
    """Cycle momentum inversely to the learning rate."""
    cycle_min_mom: Float = Field(0.8, ge=0, le=1)
    """Momentum at the peak learning rate."""
    cycle_max_mom: Float = Field(0.9, ge=0, le=1)
    """Momentum at the start and end of the cycle."""
    decay_mom_rate: Float = Field(0.0, ge=0)
    """Momentum decay rate after the cycle."""
    last_batch_iteration: Int = Field(-1, ge=-1)
    """Step to resume from; -1 starts a new schedule."""


class WarmupLRConfig(TypedBlock):
    """``{"type": "WarmupLR"}``."""

    type: Literal["WarmupLR"]
    """The scheduler type."""
    params: WarmupLRParams = Field(default_factory=empty_block)
    """Schedule parameters."""


class WarmupDecayLRConfig(TypedBlock):
    """``{"type": "WarmupDecayLR"}``."""

    type: Literal["WarmupDecayLR"]
    """The scheduler type."""
    params: WarmupDecayLRParams = Field(default_factory=empty_block)
    """Schedule parameters (``total_num_steps`` is required)."""


class WarmupCosineLRConfig(TypedBlock):
    """``{"type": "WarmupCosineLR"}``."""

    type: Literal["WarmupCosineLR"]
    """The scheduler type."""
    params: WarmupCosineLRParams = Field(default_factory=empty_block)
    """Schedule parameters (``total_num_steps`` is required)."""


class OneCycleConfig(TypedBlock):
    """``{"type": "OneCycle"}``."""

    type: Literal["OneCycle"]
    """The scheduler type."""
    params: OneCycleParams = Field(default_factory=empty_block)
    """Schedule parameters (``cycle_min_lr`` and ``cycle_max_lr`` are required)."""


SchedulerConfig = Annotated[
    Annotated[WarmupLRConfig, Tag("WarmupLR")]
    | Annotated[WarmupDecayLRConfig, Tag("WarmupDecayLR")]
    | Annotated[WarmupCosineLRConfig, Tag("WarmupCosineLR")]
    | Annotated[OneCycleConfig, Tag("OneCycle")],
    type_discriminator(SCHEDULER_TYPES),
]
"""The ``scheduler`` block; ``.type`` and ``.params`` on every member."""

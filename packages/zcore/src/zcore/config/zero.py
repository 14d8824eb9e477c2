"""``zero_optimization``: the ZeRO stage, its communication buckets, stage-3
parameter fetching and the offload blocks, with DeepSpeed's names and defaults.

Offload devices other than ``"none"`` are gated (zoffload builds them); the
gate lives in :mod:`zcore.config.features`, the checks here only concern how
the keys fit together.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from zcore.config._base import Bool, Float, Int, ZModel
from zcore.config.errors import problem_at
from zcore.config.old_keys import OldKey, offload_to_cpu, read_not_applied

OffloadDevice = Literal["none", "cpu", "nvme"]

_ZERO_CONFIG = "runtime/zero/config.py: deprecated, with new_param"


class OffloadConfig(ZModel):
    """Keys shared by ``offload_optimizer`` and ``offload_param``."""

    device: OffloadDevice = "none"
    """Where the offloaded tensors live: ``"none"`` (on the GPU), ``"cpu"`` or ``"nvme"``."""
    nvme_path: str | None = None
    """Directory on a local NVMe drive; required with ``device: "nvme"``."""
    pin_memory: Bool = False
    """Keep the CPU copies in page-locked memory for faster transfers."""
    buffer_count: Int = Field(4, ge=1)
    """Staging buffers for NVMe reads and writes."""

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> OffloadConfig:
        if self.device == "nvme" and not self.nvme_path:
            raise problem_at(
                "nvme_path",
                self.nvme_path,
                'device "nvme" needs nvme_path, a directory on a local NVMe drive',
            )
        return self


class OffloadOptimizerConfig(OffloadConfig):
    """``offload_optimizer``: keep optimizer states (and run the step) off the GPU."""

    pipeline_read: Bool = True
    """Overlap reading the next sub-group's states from NVMe with the current step
    (DeepSpeed defaults to false; zcore to true, since it never loses)."""
    pipeline_write: Bool = True
    """Overlap writing updated states to NVMe with the next step (DeepSpeed defaults to
    false; zcore to true)."""
    fast_init: Bool = False
    """Initialize NVMe-offloaded states without a full round trip through the drive."""
    ratio: Float = Field(1.0, ge=0, le=1)
    """Fraction of the optimizer states that is offloaded (the rest stays on the GPU)."""


class OffloadParamConfig(OffloadConfig):
    """``offload_param``: keep ZeRO-3 parameter shards off the GPU."""

    buffer_count: Int = Field(5, ge=1)
    """Staging buffers for NVMe reads and writes."""
    buffer_size: Int = Field(100_000_000, ge=1)
    """Elements per staging buffer."""
    max_in_cpu: Int = Field(1_000_000_000, ge=0)
    """Elements kept in CPU memory when parameters go to NVMe."""


class ZeroConfig(ZModel):
    """``zero_optimization``: which training state is partitioned across ranks and how."""

    aliases: ClassVar[dict[str, OldKey]] = {
        "stage3_gather_fp16_weights_on_model_save": OldKey(
            "stage3_gather_16bit_weights_on_model_save", _ZERO_CONFIG
        ),
        "cpu_offload": OldKey("offload_optimizer", _ZERO_CONFIG, offload_to_cpu),
        "cpu_offload_param": OldKey("offload_param", _ZERO_CONFIG, offload_to_cpu),
        "cpu_offload_params": OldKey(
            "offload_param",
            "runtime/zero/constants.py before the pydantic config, deprecated there too",
            offload_to_cpu,
        ),
        "cpu_offload_use_pin_memory": OldKey(
            "offload_optimizer.pin_memory",
            "runtime/zero/config.py: deprecated with set_new_param false",
            read_not_applied,
            note=", as in DeepSpeed; pinning is `pin_memory` in `offload_optimizer` and "
            "`offload_param`",
        ),
    }

    stage: Int = Field(0, ge=0, le=3)
    """0: plain data parallel; 1: optimizer states partitioned; 2: also gradients;
    3: also parameters."""
    overlap_comm: Bool | None = None
    """Overlap gradient reduction with backward; None means DeepSpeed's default (on for
    stage 3 only), see :attr:`effective_overlap_comm`."""
    contiguous_gradients: Bool = True
    """Copy gradients into one contiguous buffer as they are produced. zcore always does
    (each gradient is copied into a reused bucket buffer and dropped), so ``false`` reads
    the same; the key is accepted for DeepSpeed configs."""
    reduce_bucket_size: Int = Field(500_000_000, gt=0)
    """Elements reduced per collective."""
    allgather_bucket_size: Int = Field(500_000_000, gt=0)
    """Elements all-gathered per collective (stages 1 and 2)."""
    allgather_partitions: Bool = True
    """Gather updated parameters with all-gather (else a broadcast per rank)."""
    reduce_scatter: Bool = True
    """Reduce gradients with reduce-scatter (else all-reduce)."""
    stage3_prefetch_bucket_size: Int = Field(50_000_000, ge=0)
    """Elements of parameters fetched ahead of use (stage 3)."""
    stage3_param_persistence_threshold: Int = Field(100_000, ge=0)
    """Parameters with fewer elements stay unpartitioned (stage 3)."""
    stage3_max_live_parameters: Int = Field(1_000_000_000, gt=0)
    """Most elements of gathered parameters held at once per rank (stage 3)."""
    stage3_max_reuse_distance: Int = Field(1_000_000_000, ge=0)
    """A parameter used again within this many elements is not released (stage 3)."""
    stage3_gather_16bit_weights_on_model_save: Bool = False
    """Gather the full 16-bit weights when saving the model (stage 3); DeepSpeed's old name
    ``stage3_gather_fp16_weights_on_model_save`` is read too."""
    sub_group_size: Int = Field(1_000_000_000, gt=0)
    """Elements per optimizer-step sub-group: the tile the step walks when optimizer state
    is on NVMe (zoffload). An in-memory step has no per-tile temporaries to bound."""
    mics_shard_size: Int = Field(-1, ge=-1)
    """Ranks one copy of the ZeRO partition is cut across (DeepSpeed's MiCS); the job holds
    world size / this many replicas of it, and gradients are summed across them. -1: every
    data-parallel rank (one copy). Sizes the mesh's ``dp`` axis (:mod:`zcore.comm.mesh`)."""
    offload_optimizer: OffloadOptimizerConfig | None = None
    """Optimizer-state offload (provided by zoffload)."""
    offload_param: OffloadParamConfig | None = None
    """Parameter offload, stage 3 only (provided by zoffload)."""

    @field_validator("mics_shard_size")
    @classmethod
    def _mics_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("mics_shard_size must be -1 (every rank) or a positive rank count")
        return value

    @field_validator("stage", mode="before")
    @classmethod
    def _known_stage(cls, value: Any) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool) and value not in range(4):
            raise ValueError("stage must be 0, 1, 2 or 3")
        return value

    @field_validator("offload_optimizer")
    @classmethod
    def _offload_optimizer_needs_zero(
        cls, value: OffloadOptimizerConfig | None, info: ValidationInfo
    ) -> OffloadOptimizerConfig | None:
        stage = info.data.get("stage")
        if value is not None and value.device != "none" and stage == 0:
            raise problem_at(
                "device",
                value.device,
                "offloading the optimizer needs ZeRO stage 1, 2 or 3 "
                '(zero_optimization.stage is 0); raise the stage or set device to "none"',
            )
        return value

    @field_validator("offload_param")
    @classmethod
    def _offload_param_needs_stage3(
        cls, value: OffloadParamConfig | None, info: ValidationInfo
    ) -> OffloadParamConfig | None:
        stage = info.data.get("stage")
        if value is not None and value.device != "none" and stage is not None and stage != 3:
            raise problem_at(
                "device",
                value.device,
                f"offloading parameters needs ZeRO stage 3 (zero_optimization.stage is {stage}); "
                'set stage to 3 or device to "none"',
            )
        return value

    @property
    def effective_overlap_comm(self) -> bool:
        """``overlap_comm`` as DeepSpeed resolves it: given value, else True only for stage 3."""
        return self.overlap_comm if self.overlap_comm is not None else self.stage == 3

    @property
    def offload_optimizer_device(self) -> OffloadDevice:
        """Where optimizer states live (``"none"`` without an ``offload_optimizer`` block)."""
        return self.offload_optimizer.device if self.offload_optimizer else "none"

    @property
    def offload_param_device(self) -> OffloadDevice:
        """Where parameter shards live (``"none"`` without an ``offload_param`` block)."""
        return self.offload_param.device if self.offload_param else "none"

"""``aio``: DeepSpeed's async file-IO block, read by zoffload's NVMe offload.

The key is gated until zoffload (which builds NVMe offload) registers it; its values are
validated here like every other block.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    AliasChoices,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from zcore.config._base import ZModel
from zcore.config.old_keys import OldKey

#: O_DIRECT alignment of buffer addresses, file offsets and lengths, in bytes.
ALIGNMENT = 4096


class AioConfig(ZModel):
    """DeepSpeed's ``aio`` config block (same keys and defaults), plus ``backend``."""

    model_config = ConfigDict(**ZModel.model_config, populate_by_name=True)

    aliases: ClassVar[dict[str, OldKey]] = {
        "thread_count": OldKey(
            "intra_op_parallelism",
            "runtime/swap_tensor/constants.py: AIO_THREAD_COUNT, now AIO_INTRA_OP_PARALLELISM",
        )
    }

    block_size: StrictInt = Field(1048576, ge=ALIGNMENT, le=1 << 30)
    """Bytes per IO request to the kernel; requests are split into blocks of this size.
    A multiple of 4096 (the O_DIRECT alignment)."""
    queue_depth: StrictInt = Field(8, ge=1, le=4096)
    """IOs in flight per worker: the io_uring ring size. The thread backend runs
    ``queue_depth * intra_op_parallelism`` threads (at most 64), one IO each."""
    intra_op_parallelism: StrictInt = Field(
        1,
        ge=1,
        le=256,
        validation_alias=AliasChoices("intra_op_parallelism", "thread_count"),
    )
    """Workers (each with its own ring) sharing the blocks of every request.
    DeepSpeed's older name ``thread_count`` is accepted."""
    single_submit: StrictBool = False
    """io_uring: enter the kernel once per block rather than once per batch."""
    overlap_events: StrictBool = True
    """io_uring: refill the ring as each IO completes; when false a worker waits
    for its whole batch before submitting more."""
    use_gds: StrictBool = False
    """DeepSpeed's GPUDirect Storage switch; only ``false`` is supported."""
    backend: Literal["auto", "io_uring", "threads"] = "auto"
    """``auto`` takes io_uring when ``io_uring_setup`` works here, else threads."""

    @model_validator(mode="before")
    @classmethod
    def _one_thread_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "thread_count" in data and "intra_op_parallelism" in data:
            a, b = data["thread_count"], data["intra_op_parallelism"]
            if a != b:
                raise ValueError(
                    f"thread_count {a!r} and intra_op_parallelism {b!r} name the same setting; "
                    "keep only intra_op_parallelism"
                )
            data = {k: v for k, v in data.items() if k != "thread_count"}
        return data

    @field_validator("block_size")
    @classmethod
    def _aligned_block(cls, value: int) -> int:
        if value % ALIGNMENT:
            up = -(-value // ALIGNMENT) * ALIGNMENT
            raise ValueError(
                f"block_size {value} is not a multiple of {ALIGNMENT} (O_DIRECT alignment); "
                f"use {up}"
            )
        return value

    @field_validator("use_gds")
    @classmethod
    def _no_gds(cls, value: bool) -> bool:
        if value:
            raise ValueError("GPUDirect Storage is not supported; set use_gds to false")
        return value

"""The ``pipeline`` config block: DeepSpeed's keys, plus the schedule.

DeepSpeed reads ``stages``, ``partition``, ``seed_layers``, ``activation_checkpoint_interval``,
``pipe_partitioned`` and ``grad_partitioned``; the layout itself comes from the
``PipelineModule``, so these keys must agree with it (a disagreement is an error naming
both values, never silently one of them). ``schedule`` is zstack's: which of
``torch.distributed.pipelining``'s schedules runs the micro-batches. The number of
micro-batches per ``train_batch`` is ``gradient_accumulation_steps``, as in DeepSpeed.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from zcore.config._base import Bool, Int, ZModel

ScheduleName = Literal["1f1b", "gpipe", "interleaved_1f1b", "zbv"]


class PipelineConfig(ZModel):
    """``pipeline``: how a ``PipelineModule`` is run (see the module docstring)."""

    stages: Int | Literal["auto"] = "auto"
    """Pipeline stages; ``"auto"`` takes the model's ``num_stages``, a number must equal it."""
    partition: Literal["best", "parameters", "uniform"] | str = "best"
    """DeepSpeed's key: ``"best"`` takes the model's ``partition_method``; any other value
    must equal it (``PipelineModule(partition_method=...)`` cuts the layers)."""
    seed_layers: Bool = False
    """Seed each layer's construction with ``base_seed + index``; true must match the
    model's ``seed_layers`` (the layers are built when the model is, before the config)."""
    activation_checkpoint_interval: Int = Field(0, ge=0)
    """Checkpoint every this many layers of a stage (0: the model's own setting)."""
    pipe_partitioned: Bool = True
    """DeepSpeed: cut the activations sent between stages across tensor-parallel ranks.
    With tensor-parallel size 1 there is nothing to cut; refused with tp > 1."""
    grad_partitioned: Bool = True
    """The same for the gradients sent back; refused with tp > 1."""
    schedule: ScheduleName = "1f1b"
    """``gpipe``, ``1f1b`` (default), ``interleaved_1f1b`` (``virtual_stages >= 2``,
    ``stage_order="loop"``), ``zbv`` (zero-bubble V: ``virtual_stages=2, stage_order="v"``)."""

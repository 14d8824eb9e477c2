"""The pipeline schedules by name, and what each needs of the model and the batch.

All four are ``torch.distributed.pipelining``'s; zcore only picks one and checks, before
the first step, that the model's stage layout and the micro-batch count suit it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed import pipelining as tp


@dataclass(frozen=True)
class ScheduleKind:
    name: str
    cls: type
    multi: bool
    """Whether it takes a list of stages per rank (``PipelineScheduleMulti``)."""
    order: str
    """The stage layout it needs: ``loop`` or ``v``."""


SCHEDULES: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind("gpipe", tp.ScheduleGPipe, False, "loop"),
    "1f1b": ScheduleKind("1f1b", tp.Schedule1F1B, False, "loop"),
    "interleaved_1f1b": ScheduleKind("interleaved_1f1b", tp.ScheduleInterleaved1F1B, True, "loop"),
    "zbv": ScheduleKind("zbv", tp.ScheduleZBVZeroBubble, True, "v"),
}


def check_layout(name: str, virtual: int, order: str, pp: int, micro: int) -> ScheduleKind:
    """The schedule ``name`` after checking the model's layout and the micro-batch count;
    a ``ValueError`` naming the numbers and the fix otherwise."""
    kind = SCHEDULES.get(name)
    if kind is None:
        raise ValueError(
            f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
        )
    here = f"PipelineModule(virtual_stages={virtual}, stage_order={order!r})"
    if kind.name == "zbv" and (virtual != 2 or order != "v"):
        raise ValueError(
            f"schedule 'zbv' runs two stages per rank in a V; the model is {here}: build it "
            "with virtual_stages=2, stage_order='v'"
        )
    if kind.name == "interleaved_1f1b" and (virtual < 2 or order != "loop"):
        raise ValueError(
            f"schedule 'interleaved_1f1b' needs several stages per rank in a loop; the model "
            f"is {here}: build it with virtual_stages=2 (or more), stage_order='loop'"
        )
    if not kind.multi and virtual != 1:
        raise ValueError(
            f"schedule {name!r} runs one stage per rank; the model is {here}: build it with "
            "virtual_stages=1, or choose 'interleaved_1f1b' / 'zbv'"
        )
    need = pp if kind.name in ("1f1b", "interleaved_1f1b") else 1
    if micro < need:
        raise ValueError(
            f"schedule {name!r} needs at least as many micro-batches as pipeline ranks: "
            f"gradient_accumulation_steps {micro} < pp {pp}; set gradient_accumulation_steps "
            f">= {pp}"
        )
    return kind

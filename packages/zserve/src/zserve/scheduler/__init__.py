"""Scheduling policies behind one interface (see `interface.py`)."""

from zserve.scheduler.interface import (
    BaseScheduler,
    ScheduledChunk,
    Scheduler,
    SchedulerOutput,
)
from zserve.scheduler.prefill_first import PrefillFirstScheduler
from zserve.scheduler.request import SeqStatus, Sequence
from zserve.scheduler.splitfuse import SplitFuseScheduler

__all__ = [
    "BaseScheduler",
    "PrefillFirstScheduler",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
    "SeqStatus",
    "Sequence",
    "SplitFuseScheduler",
]

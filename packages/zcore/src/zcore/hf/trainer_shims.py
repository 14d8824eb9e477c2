"""What :class:`zcore.hf.Trainer` hands transformers' loop in place of its optimizer and scheduler.

The engine steps the optimizer and the learning-rate schedule itself, at the end of the
accumulation cycle's last ``backward`` (as DeepSpeed's engine does under transformers, whose
``DeepSpeedOptimizerWrapper`` and ``DeepSpeedSchedulerWrapper`` play the same part): the
loop's own ``optimizer.step()``, ``zero_grad()`` and ``lr_scheduler.step()`` that follow must
do nothing. Nothing here imports transformers.
"""

from __future__ import annotations

from typing import Any


class EngineOptimizer:
    """The Trainer's ``optimizer``: the engine's param groups; stepping is the engine's."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return getattr(self.engine.optimizer, "defaults", {})

    def step(self, closure: Any = None) -> None:
        """No-op: the engine stepped at the cycle's last micro-step."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: the engine clears its partitions after each step."""

    def state_dict(self) -> dict[str, Any]:
        """Empty: the optimizer state is sharded into the engine's checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """No-op: the engine's checkpoint restores the optimizer state."""


class EngineScheduler:
    """The Trainer's ``lr_scheduler``: reports the learning rate of the step just taken.

    ``get_last_lr`` is what the loop logs after its optimizer step, when the engine has
    already moved the schedule on; the Trainer records the rates the step used just before
    the engine steps (:meth:`record`), so the logged rate is the plain Trainer's.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._last: list[float] | None = None

    def record(self) -> None:
        """Keep the rates the coming optimizer step uses."""
        self._last = self.engine.get_lr()

    def get_last_lr(self) -> list[float]:
        return list(self._last if self._last is not None else self.engine.get_lr())

    def step(self, *args: Any, **kwargs: Any) -> None:
        """No-op: the engine stepped the schedule with the optimizer."""

    def state_dict(self) -> dict[str, Any]:
        """The engine's schedule state (also saved in the engine's checkpoint)."""
        scheduler = self.engine.lr_scheduler
        return scheduler.state_dict() if scheduler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """No-op: the engine's checkpoint restores the schedule."""

"""Curriculum schedules: the difficulty at each training step.

The four schedule types of DeepSpeed's ``curriculum_scheduler.py``, with its semantics
(steps count from 1: the first optimizer step asks for step 1):

- ``fixed_linear``: ``d(s) = floor((s / T) * (max - min) + min)``, rounded *down* to a
  multiple of ``difficulty_step`` and capped at ``max``; ``T`` is ``total_curriculum_step``;
- ``fixed_root``: the same with ``(s / T) ** (1 / root_degree)`` in place of ``s / T``;
- ``fixed_discrete``: ``difficulty[i]`` for the first ``i`` with ``s <= max_step[i]``,
  ``difficulty[-1]`` past the last ``max_step``;
- ``custom``: a function ``step -> difficulty`` registered by name
  (:func:`register_curriculum_schedule`).

Once the difficulty reaches ``max_difficulty`` it stays there (DeepSpeed stops asking the
schedule), which is what :class:`CurriculumScheduler` keeps as its state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from zcore.data_efficiency.config import ScheduleFields

Difficulty = int | float
ScheduleFn = Callable[[int], Difficulty]

_custom: dict[str, ScheduleFn] = {}


def register_curriculum_schedule(name: str, fn: ScheduleFn, *, replace: bool = False) -> None:
    """Make ``fn(step) -> difficulty`` the ``custom`` schedule called ``name`` (the metric's
    name, or ``schedule_config.name``). Registering another function under a taken name is
    an error unless ``replace``."""
    if not callable(fn):
        raise TypeError(f"register_curriculum_schedule({name!r}): {fn!r} is not callable")
    old = _custom.get(name)
    if old is not None and old is not fn and not replace:
        raise ValueError(
            f"curriculum schedule {name!r} is already registered ({old!r}); pass replace=True"
        )
    _custom[name] = fn


def unregister_curriculum_schedule(name: str) -> None:
    """Forget the custom schedule ``name`` (tests, mostly)."""
    _custom.pop(name, None)


def root_difficulty(
    step: int, lo: Difficulty, hi: Difficulty, total: int, difficulty_step: int, degree: float
) -> Difficulty:
    """``fixed_root`` (``degree`` 1: ``fixed_linear``) at ``step``: see the module docstring."""
    d = math.floor((float(step) / total) ** (1.0 / degree) * (hi - lo) + lo)
    d -= d % difficulty_step
    return min(d, hi)


def discrete_difficulty(
    step: int, difficulties: list[Difficulty], max_steps: list[int]
) -> Difficulty:
    """``fixed_discrete`` at ``step``: see the module docstring."""
    for d, last in zip(difficulties, max_steps, strict=False):
        if step <= last:
            return d
    return difficulties[-1]


class CurriculumScheduler:
    """The difficulty of one metric (or of the legacy sequence length) by step.

    ``update(step)`` moves it on and returns it; ``state_dict``/``load_state_dict`` keep
    the current difficulty for a checkpoint.
    """

    def __init__(self, config: ScheduleFields, name: str = "seqlen") -> None:
        config.check_schedule()  # a block built without validation (model_construct)
        assert config.min_difficulty is not None and config.max_difficulty is not None
        self.name = name
        self.config = config
        self.min: Difficulty = config.min_difficulty
        self.max: Difficulty = config.max_difficulty
        self.current: Difficulty = self.min
        self._fn = self._schedule_fn()

    def _schedule_fn(self) -> ScheduleFn:
        sc, kind = self.config.schedule_config, self.config.schedule_type
        if kind in ("fixed_linear", "fixed_root"):
            degree = 1 if kind == "fixed_linear" else sc.root_degree
            total, step_size = sc.total_curriculum_step, sc.difficulty_step
            assert degree is not None and total is not None and step_size is not None
            return lambda s: root_difficulty(s, self.min, self.max, total, step_size, degree)
        if kind == "fixed_discrete":
            assert sc.difficulty is not None and sc.max_step is not None
            difficulties, max_steps = list(sc.difficulty), list(sc.max_step)
            return lambda s: discrete_difficulty(s, difficulties, max_steps)
        key = sc.name or self.name
        fn = _custom.get(key)
        if fn is None:
            known = ", ".join(sorted(_custom)) or "none"
            raise ValueError(
                f'curriculum metric {self.name!r}: schedule_type "custom" needs a function '
                f"registered as {key!r}; call "
                f"`zcore.data_efficiency.register_curriculum_schedule({key!r}, fn)` before "
                f"training, or set schedule_config.name (registered: {known})"
            )
        return fn

    def difficulty_at(self, step: int) -> Difficulty:
        """The schedule's value at ``step`` (1-based), ignoring the state."""
        return self._fn(step)

    def update(self, step: int) -> Difficulty:
        """The difficulty of ``step`` (1-based); it stays at ``max`` once there."""
        if self.current < self.max:
            self.current = self._fn(step)
        return self.current

    def state_dict(self) -> dict[str, Any]:
        return {"current_difficulty": self.current}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current = state["current_difficulty"]

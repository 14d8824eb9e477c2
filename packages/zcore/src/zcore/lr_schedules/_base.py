"""What every schedule shares: argument checks, resume preparation, and
``_IterationSchedule``, a torch ``LRScheduler`` on DeepSpeed's step convention (see
``zcore.lr_schedules``) whose lr is a closed-form function of the iteration."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler


def _unwrap(optimizer: Any) -> Optimizer:
    """The torch optimizer itself, or the one a wrapper holds in ``.optimizer``."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer")


def _per_group(value: float | Sequence[float], name: str, optimizer: Optimizer) -> list[float]:
    """One value per param group: a scalar is repeated, a sequence must match the group count."""
    n = len(optimizer.param_groups)
    if isinstance(value, Sequence):
        if len(value) != n:
            raise ValueError(
                f"{name} has {len(value)} values {list(value)} but the optimizer has {n} "
                "param groups; give one value per group or a single number"
            )
        values = [float(v) for v in value]
    else:
        values = [float(value)] * n
    for v in values:
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    return values


def _check_int(value: int, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_ratio(value: float, name: str) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return float(value)


def _prepare_resume(optimizer: Optimizer, last_batch_iteration: int) -> None:
    """Let a fresh optimizer resume at ``last_batch_iteration`` as DeepSpeed allows.

    torch refuses ``last_epoch >= 0`` unless every group has ``initial_lr`` (normally
    restored with the optimizer's state dict); default it to the group's current lr.
    """
    _check_int(last_batch_iteration, "last_batch_iteration", -1)
    if last_batch_iteration >= 0:
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])


class _IterationSchedule(LRScheduler):
    """A schedule that is a closed-form function of the iteration (``last_epoch``).

    ``_lrs_at(-1)`` is the value a new schedule starts the optimizer at.
    """

    def _lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def _initial_step(self) -> None:
        # torch's constructor ends with a step() that advances last_epoch and applies
        # get_lr(); DeepSpeed's constructors do not advance. Step back one first, so that
        # this step lands where DeepSpeed starts and keeps torch's step bookkeeping.
        self.last_epoch -= 1
        super()._initial_step()

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's name for ``last_epoch``: the index of the last batch done."""
        return self.last_epoch

    @last_batch_iteration.setter
    def last_batch_iteration(self, value: int) -> None:
        self.last_epoch = value

    def get_lr(self) -> list[float | torch.Tensor]:
        """The learning rates at the current iteration, one per param group."""
        lrs: list[float | torch.Tensor] = [*self._lrs_at(self.last_epoch)]
        return lrs

    # step(epoch) is deprecated in torch but still routed here; our formulas are closed form.
    _get_closed_form_lr = get_lr

    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's scheduler state: ``{"last_batch_iteration": n}``."""
        return {"last_batch_iteration": self.last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at ``state_dict["last_batch_iteration"]`` (or an older zcore checkpoint's
        ``last_epoch``). As in DeepSpeed only the position is restored; the schedule's
        parameters stay this scheduler's. The optimizer gets the values at that position,
        which its own restored state holds too; without it (``load_optimizer_states=False``)
        the run still continues on the schedule."""
        key = "last_batch_iteration" if "last_batch_iteration" in state_dict else "last_epoch"
        if key not in state_dict:
            raise KeyError(
                f"{type(self).__name__} state dict needs `last_batch_iteration`, got keys "
                f"{sorted(state_dict)}"
            )
        self.last_epoch = _check_int(state_dict[key], key, -1)
        self._apply()

    def _apply(self) -> None:
        """Set the optimizer to the schedule's values at ``last_epoch``."""
        for group, lr in zip(
            self.optimizer.param_groups, self._lrs_at(self.last_epoch), strict=True
        ):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [
            g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
            for g in self.optimizer.param_groups
        ]

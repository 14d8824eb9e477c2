"""DeepSpeed's 1Cycle policy (``OneCycle``): one triangular lr cycle with momentum
moving inversely, then an optional decay."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from torch.optim import Optimizer

from zcore.lr_schedules._base import (
    _check_int,
    _IterationSchedule,
    _per_group,
    _prepare_resume,
    _unwrap,
)

logger = logging.getLogger(__name__)


class OneCycle(_IterationSchedule):
    """DeepSpeed's 1Cycle policy: one triangular lr cycle, then an optional decay.

    The cycle spans ``cycle_first_step_size`` iterations rising from ``cycle_min_lr`` to
    ``cycle_max_lr`` and ``cycle_second_step_size`` (default: the first; 0 allowed, as in
    DeepSpeed) falling back. Like DeepSpeed, iteration ``k`` takes the triangle at position
    ``k + 1``, so the peak is at iteration ``cycle_first_step_size - 1`` and the trough at
    the cycle's last iteration. With ``cycle_first_stair_count`` / ``cycle_second_stair_count``
    ``> 0`` (the second defaults to the first) each half climbs in that many flat stairs
    instead of continuously, as in DeepSpeed 0.19.8. After the cycle, if
    ``decay_step_size > 0``, the lr is ``cycle_min_lr / (1 + decay_lr_rate * d /
    decay_step_size)`` with ``d`` iterations since the cycle.

    With ``cycle_momentum`` the momentum (``betas[0]`` for Adam-style optimizers,
    ``momentum`` for SGD) moves inversely between ``cycle_max_mom`` and ``cycle_min_mom``
    and after the cycle is ``cycle_max_mom * (1 + decay_mom_rate * d / decay_step_size)``.
    An optimizer with neither is left alone (logged). Unlike DeepSpeed, ``betas[1]`` keeps
    the optimizer's value rather than being set to 0.99, and SGD's ``momentum`` cycles too.

    A new schedule starts the optimizer at ``cycle_min_lr`` and ``cycle_min_mom`` (what
    DeepSpeed's constructor sets, though the cycle's momentum at that point would be
    ``cycle_max_mom``).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        optimizer = _unwrap(optimizer)
        first = _check_int(cycle_first_step_size, "cycle_first_step_size", 1)
        second = first
        if cycle_second_step_size is not None:
            second = _check_int(cycle_second_step_size, "cycle_second_step_size", 0)
        self.first_stair_count = _check_int(cycle_first_stair_count, "cycle_first_stair_count", 0)
        self.second_stair_count = self.first_stair_count
        if cycle_second_stair_count is not None:
            self.second_stair_count = _check_int(
                cycle_second_stair_count, "cycle_second_stair_count", 0
            )
        self.first_step_size = first
        self.second_step_size = second
        self.total_size = first + second
        self.decay_step_size = _check_int(decay_step_size, "decay_step_size", 0)
        self.min_lrs = _per_group(cycle_min_lr, "cycle_min_lr", optimizer)
        self.max_lrs = _per_group(cycle_max_lr, "cycle_max_lr", optimizer)
        self.decay_lr_rate = float(decay_lr_rate)
        self.min_moms = _per_group(cycle_min_mom, "cycle_min_mom", optimizer)
        self.max_moms = _per_group(cycle_max_mom, "cycle_max_mom", optimizer)
        self.decay_mom_rate = float(decay_mom_rate)
        self.momentum_key: str | None = None
        if cycle_momentum:
            if "betas" in optimizer.defaults:
                self.momentum_key = "betas"
            elif "momentum" in optimizer.defaults:
                self.momentum_key = "momentum"
            else:
                logger.warning(
                    "OneCycle: cycle_momentum disabled: %s has neither `betas` nor `momentum`",
                    type(optimizer).__name__,
                )
        self.cycle_momentum = self.momentum_key is not None
        _prepare_resume(optimizer, last_batch_iteration)
        super().__init__(optimizer, last_batch_iteration)

    def _scale(self, iteration: int) -> float:
        """Height in [0, 1] of the triangle at iteration ``iteration`` (< total_size)."""
        position = iteration + 1
        step_ratio = self.first_step_size / self.total_size
        x = position / self.total_size - math.floor(position / self.total_size)
        if x <= step_ratio:
            scale, stairs = x / step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1.0) / (step_ratio - 1.0), self.second_stair_count
        if stairs > 0:
            # DeepSpeed floors the stair from the integer offset into the cycle, not from
            # `scale`, whose float value can land just under a stair boundary.
            offset = position % self.total_size
            if offset <= self.first_step_size:
                stair = offset * stairs / self.first_step_size
            else:
                stair = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def _decay_interval(self, iteration: int) -> float | None:
        """Decay intervals elapsed after the cycle, or None while cycling / without decay."""
        if iteration < self.total_size or self.decay_step_size == 0:
            return None
        return (iteration - self.total_size + 1) / self.decay_step_size

    def _lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [
                lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)
            ]
        interval = self._decay_interval(iteration)
        if interval is None:
            return list(self.min_lrs)
        return [lo / (1.0 + self.decay_lr_rate * interval) for lo in self.min_lrs]

    def moms_at(self, iteration: int) -> list[float]:
        """The momentum (``betas[0]`` / ``momentum``) for each group at ``iteration``."""
        if iteration < 0:
            return list(self.min_moms)  # what DeepSpeed's constructor sets
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [
                hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms, strict=True)
            ]
        interval = self._decay_interval(iteration)
        if interval is None:
            return list(self.max_moms)
        return [hi * (1.0 + self.decay_mom_rate * interval) for hi in self.max_moms]

    def step(self, epoch: int | None = None) -> None:
        """Advance one iteration: set each group's lr and, if cycling, its momentum."""
        super().step(epoch)
        self._apply_momentum()

    def _apply(self) -> None:
        super()._apply()
        self._apply_momentum()

    def _apply_momentum(self) -> None:
        if self.momentum_key is None:
            return
        for group, mom in zip(
            self.optimizer.param_groups, self.moms_at(self.last_epoch), strict=True
        ):
            if self.momentum_key == "betas":
                group["betas"] = (mom, *tuple(group["betas"])[1:])
            else:
                group["momentum"] = mom

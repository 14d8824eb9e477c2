"""The warmup family: ``WarmupLR``, ``WarmupDecayLR`` (then linear decay) and
``WarmupCosineLR`` (then cosine decay), with DeepSpeed's parameters and formulas."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from torch.optim import Optimizer

from zcore.lr_schedules._base import (
    _check_int,
    _check_ratio,
    _IterationSchedule,
    _per_group,
    _prepare_resume,
    _unwrap,
)

logger = logging.getLogger(__name__)

WARMUP_TYPES = ("log", "linear")


def _check_warmup_type(warmup_type: str) -> str:
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {list(WARMUP_TYPES)}, got {warmup_type!r}")
    return warmup_type


def _warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done at ``iteration`` (< warmup_num_steps), in [0, 1)."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


def _warn_no_decay(total_num_steps: int, warmup_num_steps: int, floor: str) -> None:
    """DeepSpeed runs a schedule whose decay phase is empty, logging a warning; so do we."""
    if total_num_steps <= warmup_num_steps:
        logger.warning(
            "total_num_steps %d is not greater than warmup_num_steps %d: there is no decay "
            "phase, the lr drops to %s right after warmup; raise total_num_steps to the "
            "number of optimizer steps of the run",
            total_num_steps,
            warmup_num_steps,
            floor,
        )


class WarmupLR(_IterationSchedule):
    """Warm each group's lr up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    At iteration ``k < warmup_num_steps`` the lr is ``min + (max - min) * gamma`` with
    ``gamma = log(k + 1) / log(warmup_num_steps)`` (``"log"``) or
    ``k / warmup_num_steps`` (``"linear"``); afterwards it is ``warmup_max_lr``. A new
    schedule starts the optimizer at ``warmup_min_lr`` (iteration -1, see ``zcore.lr_schedules``).
    ``warmup_min_lr`` / ``warmup_max_lr`` may be one value or a list with one per group;
    ``warmup_max_lr=None`` (the default, as in DeepSpeed) takes each group's current lr.
    Like DeepSpeed, a ``warmup_num_steps`` of 1 is treated as 2 (``log(1) == 0``).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        optimizer = _unwrap(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in optimizer.param_groups]
        self.min_lrs = _per_group(warmup_min_lr, "warmup_min_lr", optimizer)
        self.max_lrs = _per_group(warmup_max_lr, "warmup_max_lr", optimizer)
        self.warmup_num_steps = max(2, _check_int(warmup_num_steps, "warmup_num_steps", 1))
        self.warmup_type = _check_warmup_type(warmup_type)
        _prepare_resume(optimizer, last_batch_iteration)
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def _lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR`` followed by a linear decay that reaches 0 at ``total_num_steps``.

    After warmup, ``gamma = max(0, (total_num_steps - k) / max(1, total_num_steps -
    warmup_num_steps))`` scales ``warmup_max_lr - warmup_min_lr`` on top of
    ``warmup_min_lr``, as in DeepSpeed. ``warmup_max_lr`` defaults to 0.001 here, as in
    DeepSpeed. A ``total_num_steps`` not above ``warmup_num_steps`` leaves no decay: the
    lr drops to ``warmup_min_lr`` right after warmup; that is logged, as DeepSpeed does.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _check_int(total_num_steps, "total_num_steps", 1)
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )
        _warn_no_decay(total_num_steps, self.warmup_num_steps, "warmup_min_lr")

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - iteration) / decay_steps)


class WarmupCosineLR(_IterationSchedule):
    """Warm up to each group's initial lr, then cosine-decay to ``cos_min_ratio`` of it.

    The lr is ``initial_lr * ratio``. During warmup ``ratio = warmup_min_ratio + (1 -
    warmup_min_ratio) * gamma`` (gamma as in ``WarmupLR``); afterwards ``ratio =
    cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * t / T)) / 2`` with ``t = min(k -
    warmup_num_steps + 1, T)`` and ``T = max(1, total_num_steps - warmup_num_steps)``, so
    the lr reaches ``cos_min_ratio`` at iteration ``total_num_steps - 1`` and stays there,
    as in DeepSpeed 0.19.8. A new schedule starts the optimizer at lr 0 (DeepSpeed's value
    at iteration -1, whatever ``warmup_min_ratio`` is). A ``total_num_steps`` not above
    ``warmup_num_steps`` leaves no cosine (logged, as DeepSpeed does).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        optimizer = _unwrap(optimizer)
        self.total_num_steps = _check_int(total_num_steps, "total_num_steps", 1)
        self.warmup_min_ratio = _check_ratio(warmup_min_ratio, "warmup_min_ratio")
        self.cos_min_ratio = _check_ratio(cos_min_ratio, "cos_min_ratio")
        self.warmup_num_steps = max(2, _check_int(warmup_num_steps, "warmup_num_steps", 1))
        self.warmup_type = _check_warmup_type(warmup_type)
        _warn_no_decay(total_num_steps, self.warmup_num_steps, "cos_min_ratio of the lr")
        _prepare_resume(optimizer, last_batch_iteration)
        super().__init__(optimizer, last_batch_iteration)

    def _ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            gamma = _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        cosine_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        done = min(iteration - self.warmup_num_steps + 1, cosine_steps)
        cosine = (1.0 + math.cos(math.pi * done / cosine_steps)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lrs_at(self, iteration: int) -> list[float]:
        ratio = self._ratio(iteration)
        return [float(base) * ratio for base in self.base_lrs]

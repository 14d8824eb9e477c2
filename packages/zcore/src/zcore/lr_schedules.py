"""DeepSpeed's learning-rate schedules as ``torch.optim.lr_scheduler.LRScheduler`` subclasses.

``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` and ``OneCycle`` take DeepSpeed's
parameter names (the ``scheduler.params`` block of a DeepSpeed config) and compute
DeepSpeed's formulas, while behaving like any torch scheduler: ``step()``,
``get_last_lr()``, ``state_dict()`` / ``load_state_dict()``.

Step convention: ``scheduler.last_epoch`` plays the role of DeepSpeed's
``last_batch_iteration``. Right after construction ``last_epoch == 0`` and the optimizer
holds the schedule's value at iteration 0; each ``scheduler.step()`` (called once per
optimizer step, after it) advances one iteration, so the lr used by optimizer step ``k``
is the schedule at iteration ``k``. Passing ``last_batch_iteration=n`` resumes with the
optimizer at iteration ``n + 1``, the value the next DeepSpeed ``step()`` would set.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = [
    "SCHEDULERS",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
]

logger = logging.getLogger(__name__)

WARMUP_TYPES = ("log", "linear")


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


def _check_warmup_type(warmup_type: str) -> str:
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {list(WARMUP_TYPES)}, got {warmup_type!r}")
    return warmup_type


def _prepare_resume(optimizer: Optimizer, last_batch_iteration: int) -> None:
    """Let a fresh optimizer resume at ``last_batch_iteration`` as DeepSpeed allows.

    torch refuses ``last_epoch >= 0`` unless every group has ``initial_lr`` (normally
    restored with the optimizer's state dict); default it to the group's current lr.
    """
    _check_int(last_batch_iteration, "last_batch_iteration", -1)
    if last_batch_iteration >= 0:
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])


def _warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done at ``iteration`` (< warmup_num_steps), in [0, 1)."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class _IterationSchedule(LRScheduler):
    """A schedule that is a closed-form function of the iteration (``last_epoch``)."""

    def _lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float | torch.Tensor]:
        """The learning rates at the current iteration, one per param group."""
        lrs: list[float | torch.Tensor] = [*self._lrs_at(self.last_epoch)]
        return lrs

    # step(epoch) is deprecated in torch but still routed here; our formulas are closed form.
    _get_closed_form_lr = get_lr


class WarmupLR(_IterationSchedule):
    """Warm each group's lr up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    At iteration ``k < warmup_num_steps`` the lr is ``min + (max - min) * gamma`` with
    ``gamma = log(k + 1) / log(warmup_num_steps)`` (``"log"``) or
    ``k / warmup_num_steps`` (``"linear"``); afterwards it is ``warmup_max_lr``.
    ``warmup_min_lr`` / ``warmup_max_lr`` may be one value or a list with one per group.
    Like DeepSpeed, a ``warmup_num_steps`` of 1 is treated as 2 (``log(1) == 0``).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        optimizer = _unwrap(optimizer)
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
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR`` followed by a linear decay that reaches 0 at ``total_num_steps``.

    After warmup, ``gamma = max(0, (total_num_steps - k) / (total_num_steps -
    warmup_num_steps))`` scales ``warmup_max_lr - warmup_min_lr`` on top of
    ``warmup_min_lr``, as in DeepSpeed.
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
        _check_int(total_num_steps, "total_num_steps", 1)
        _check_int(warmup_num_steps, "warmup_num_steps", 1)
        if total_num_steps <= warmup_num_steps:
            raise ValueError(
                f"total_num_steps {total_num_steps} must be greater than warmup_num_steps "
                f"{warmup_num_steps}; the decay phase would be empty"
            )
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - iteration) / decay_steps)


class WarmupCosineLR(_IterationSchedule):
    """Warm up to each group's initial lr, then cosine-decay to ``cos_min_ratio`` of it.

    The lr is ``initial_lr * ratio``. During warmup ``ratio = warmup_min_ratio + (1 -
    warmup_min_ratio) * gamma`` (gamma as in ``WarmupLR``); afterwards ``ratio =
    cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * t / T)) / 2`` with ``t = k -
    warmup_num_steps + 1`` and ``T = total_num_steps - warmup_num_steps``, so the lr
    reaches ``cos_min_ratio`` at iteration ``total_num_steps - 1``. Unlike DeepSpeed,
    ``t`` is clamped to ``T`` so the lr stays at the minimum past ``total_num_steps``
    instead of climbing back up the cosine.
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
        _check_int(total_num_steps, "total_num_steps", 1)
        _check_int(warmup_num_steps, "warmup_num_steps", 1)
        if total_num_steps <= warmup_num_steps:
            raise ValueError(
                f"total_num_steps {total_num_steps} must be greater than warmup_num_steps "
                f"{warmup_num_steps}; the cosine phase would be empty"
            )
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = _check_ratio(warmup_min_ratio, "warmup_min_ratio")
        self.cos_min_ratio = _check_ratio(cos_min_ratio, "cos_min_ratio")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        _prepare_resume(optimizer, last_batch_iteration)
        super().__init__(optimizer, last_batch_iteration)

    def _ratio(self, iteration: int) -> float:
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


class OneCycle(_IterationSchedule):
    """DeepSpeed's 1Cycle policy: one triangular lr cycle, then an optional decay.

    The cycle spans ``cycle_first_step_size`` iterations rising from ``cycle_min_lr`` to
    ``cycle_max_lr`` and ``cycle_second_step_size`` (default: the first) falling back.
    Like DeepSpeed, iteration ``k`` takes the triangle at position ``k + 1``, so the peak
    is at iteration ``cycle_first_step_size - 1`` and the trough at the cycle's last
    iteration. After the cycle, if ``decay_step_size > 0``, the lr is ``cycle_min_lr /
    (1 + decay_lr_rate * d / decay_step_size)`` with ``d`` iterations since the cycle.

    With ``cycle_momentum`` the momentum (``betas[0]`` for Adam-style optimizers,
    ``momentum`` for SGD) moves inversely between ``cycle_max_mom`` and ``cycle_min_mom``
    and after the cycle is ``cycle_max_mom * (1 + decay_mom_rate * d / decay_step_size)``.
    An optimizer with neither is left alone (logged). Unlike DeepSpeed, ``betas[1]`` keeps
    the optimizer's value rather than being set to 0.99.

    ``cycle_first_stair_count`` / ``cycle_second_stair_count`` are accepted for config
    compatibility; DeepSpeed stores them without using them, and so does this class.
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
            second = _check_int(cycle_second_step_size, "cycle_second_step_size", 1)
        _check_int(cycle_first_stair_count, "cycle_first_stair_count", 0)
        if cycle_second_stair_count is not None:
            _check_int(cycle_second_stair_count, "cycle_second_stair_count", 0)
        if cycle_first_stair_count or cycle_second_stair_count:
            logger.warning(
                "OneCycle: cycle_first_stair_count %s / cycle_second_stair_count %s are "
                "ignored (as in DeepSpeed); the cycle is continuous",
                cycle_first_stair_count,
                cycle_second_stair_count,
            )
        self.first_step_size = first
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
            return x / step_ratio
        return (x - 1.0) / (step_ratio - 1.0)

    def _decay_interval(self, iteration: int) -> float | None:
        """Decay intervals elapsed after the cycle, or None while cycling / without decay."""
        if iteration < self.total_size or self.decay_step_size == 0:
            return None
        return (iteration - self.total_size + 1) / self.decay_step_size

    def _lrs_at(self, iteration: int) -> list[float]:
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
        if self.momentum_key is None:
            return
        for group, mom in zip(
            self.optimizer.param_groups, self.moms_at(self.last_epoch), strict=True
        ):
            if self.momentum_key == "betas":
                group["betas"] = (mom, *tuple(group["betas"])[1:])
            else:
                group["momentum"] = mom


SCHEDULERS: dict[str, type[LRScheduler]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
}


def build_scheduler(type_name: str, optimizer: Optimizer, params: dict[str, Any]) -> LRScheduler:
    """Build the scheduler a DeepSpeed ``"scheduler": {"type": ..., "params": ...}`` names."""
    cls = SCHEDULERS.get(type_name)
    if cls is None:
        raise ValueError(
            f"unknown scheduler type {type_name!r}; valid types: {', '.join(SCHEDULERS)}"
        )
    signature = inspect.signature(cls.__init__).parameters
    accepted = [name for name in signature if name not in ("self", "optimizer")]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"{type_name} got unknown params {unknown}; accepted: {', '.join(accepted)}"
        )
    missing = [
        name
        for name in accepted
        if signature[name].default is inspect.Parameter.empty and name not in params
    ]
    if missing:
        raise ValueError(f"{type_name} needs params {missing}; got {sorted(params)}")
    return cls(optimizer, **params)

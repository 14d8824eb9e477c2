"""DeepSpeed's learning-rate schedules as ``torch.optim.lr_scheduler.LRScheduler`` subclasses.

``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` and ``OneCycle`` take DeepSpeed's
parameter names (the ``scheduler.params`` block of a DeepSpeed config) and compute
DeepSpeed's formulas, while behaving like any torch scheduler: ``step()``,
``get_last_lr()``, ``state_dict()`` / ``load_state_dict()``.

Step convention, DeepSpeed's (``deepspeed/runtime/lr_schedules.py``, 0.19.8):
``scheduler.last_epoch`` (also readable as ``last_batch_iteration``) is the index of the
last batch done. A new schedule (``last_batch_iteration=-1``) stays at -1 and sets the
optimizer to the value DeepSpeed's constructors set: ``warmup_min_lr`` (``WarmupLR``,
``WarmupDecayLR``), 0 (``WarmupCosineLR``), ``cycle_min_lr`` and ``cycle_min_mom``
(``OneCycle``). Each ``step()``, called after each optimizer step as DeepSpeed's engine
does, advances one iteration and applies the schedule there. So optimizer step 1 runs
at that starting value and step ``k >= 2`` at the schedule's iteration ``k - 2``, the
learning rates a DeepSpeed run uses.

``last_batch_iteration=n >= 0`` resumes after batch ``n``: the optimizer gets the values
an uninterrupted run holds then (iteration ``n``) and the next ``step()`` applies
iteration ``n + 1``. DeepSpeed's constructors leave the optimizer's lr alone instead, so
that its first resumed step runs at whatever the optimizer holds (the config's lr unless
a checkpoint's optimizer state is loaded); with that state loaded, as checkpoint resumes
do, the two are the same. ``state_dict()`` is DeepSpeed's ``{"last_batch_iteration": n}``;
``load_state_dict()`` restores the position only, as DeepSpeed's (the schedule's
parameters stay the constructor's), sets the optimizer to that position's values (what
its restored state holds anyway) and also takes the ``last_epoch`` of older zcore
checkpoints.
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


class WarmupLR(_IterationSchedule):
    """Warm each group's lr up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    At iteration ``k < warmup_num_steps`` the lr is ``min + (max - min) * gamma`` with
    ``gamma = log(k + 1) / log(warmup_num_steps)`` (``"log"``) or
    ``k / warmup_num_steps`` (``"linear"``); afterwards it is ``warmup_max_lr``. A new
    schedule starts the optimizer at ``warmup_min_lr`` (iteration -1, see the module).
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

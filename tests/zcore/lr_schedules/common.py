"""Helpers for the zcore.lr_schedules tests: tiny optimizers, a driver that steps a
scheduler as DeepSpeed's engine does, and one small instance of each schedule.

Convention checked throughout, DeepSpeed's: the scheduler is stepped after each optimizer
step, so optimizer step 1 runs at the value the constructor sets (DeepSpeed's iteration
-1) and step ``k >= 2`` at the schedule's iteration ``k - 2``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from zcore.lr_schedules import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR


def make_optimizer(kind: str = "sgd", lrs: tuple[float, ...] = (0.1,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))], "lr": lr} for lr in lrs]
    if kind == "adam":
        return torch.optim.Adam(groups, betas=(0.9, 0.95))
    if kind == "sgd":
        return torch.optim.SGD(groups, momentum=0.5)
    if kind == "adagrad":
        return torch.optim.Adagrad(groups)
    raise AssertionError(kind)


def run(sched: Any, steps: int) -> list[list[float]]:
    """The lrs optimizer steps 1..steps run at, driven as DeepSpeed's engine drives a
    scheduler: optimizer.step(), then scheduler.step()."""
    out = []
    for _ in range(steps):
        lrs = [float(g["lr"]) for g in sched.optimizer.param_groups]
        if isinstance(sched, LRScheduler):
            assert lrs == [float(lr) for lr in sched.get_last_lr()]
        out.append(lrs)
        sched.optimizer.step()
        sched.step()
    return out


def warmup_gamma(k: int, w: int, kind: str) -> float:
    return math.log(k + 1) / math.log(w) if kind == "log" else k / w


def schedulers() -> dict[str, Callable[..., Any]]:
    return {
        "WarmupLR": lambda o, **kw: WarmupLR(o, 0.0, 0.1, 6, "linear", **kw),
        "WarmupDecayLR": lambda o, **kw: WarmupDecayLR(o, 20, 0.01, 0.1, 5, **kw),
        "WarmupCosineLR": lambda o, **kw: WarmupCosineLR(o, 20, 0.1, 5, 0.01, **kw),
        "OneCycle": lambda o, **kw: OneCycle(
            o, 0.01, 0.1, cycle_first_step_size=4, decay_step_size=2, decay_lr_rate=0.1, **kw
        ),
    }

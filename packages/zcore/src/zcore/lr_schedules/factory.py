"""The scheduler a DeepSpeed config's ``"scheduler"`` block names, by type."""

from __future__ import annotations

import inspect
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from zcore.lr_schedules.one_cycle import OneCycle
from zcore.lr_schedules.warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

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

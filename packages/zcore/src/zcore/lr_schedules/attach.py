"""The engine's scheduler: built from the config, or the user's, bound to the engine's optimizer."""

from __future__ import annotations

from typing import Any

import torch

from zcore.lr_schedules.factory import build_scheduler


def engine_scheduler(
    config: Any, optimizer: torch.optim.Optimizer, lr_scheduler: Any, random_ltd: Any = None
) -> Any:
    """``lr_scheduler`` (an ``LRScheduler`` of another optimizer with as many groups, or a
    callable ``optimizer -> scheduler``) bound to ``optimizer``; without one, the config's
    ``scheduler`` block; None when neither is given. The engine's ``random_ltd`` with its
    ``layer_token_lr_schedule`` on replaces that with its LayerToken schedule."""
    scheduler = _bound_scheduler(config, optimizer, lr_scheduler)
    return scheduler if random_ltd is None else random_ltd.lr_scheduler(optimizer, scheduler)


def engine_random_ltd(config: Any, engine: Any) -> Any:
    """The config's random-LTD on ``engine.module`` (None when off), its schedule moved to
    ``engine.global_steps`` before each training forward."""
    from zcore.data_efficiency.random_ltd import RandomLTD

    ltd = RandomLTD.from_config(config, engine.module, engine.batch.train_batch_size)
    if ltd is not None:
        ltd.follow(engine)
    return ltd


def _bound_scheduler(config: Any, optimizer: torch.optim.Optimizer, lr_scheduler: Any) -> Any:
    if lr_scheduler is None and config.scheduler is not None:
        sc = config.scheduler
        return build_scheduler(sc.type, optimizer, sc.params.model_dump())
    if lr_scheduler is None:
        return None
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        if len(lr_scheduler.optimizer.param_groups) != len(optimizer.param_groups):
            raise ValueError(
                "lr_scheduler was built for an optimizer with "
                f"{len(lr_scheduler.optimizer.param_groups)} param groups, the engine's has "
                f"{len(optimizer.param_groups)} (expert parameters form groups of their own); "
                "pass a callable `lambda opt: ...`"
            )
        for g, lr in zip(optimizer.param_groups, lr_scheduler.get_last_lr(), strict=True):
            g["lr"] = lr
        lr_scheduler.optimizer = optimizer
        return lr_scheduler
    if callable(lr_scheduler):
        return lr_scheduler(optimizer)
    raise TypeError(f"lr_scheduler must be an LRScheduler or a callable, got {lr_scheduler!r}")

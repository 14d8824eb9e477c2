"""Offloaded training against the same engine without offload, on the same ranks.

Each rank trains the tiny LM of ``tests.zcore.zero.common`` twice: without offload for
``steps`` steps, and with the given offload config for half of them, a checkpoint save,
a fresh engine that loads it, and the other half. Losses and final parameters of both are
returned for the test to compare.
"""

from __future__ import annotations

from typing import Any

import torch

import zcore
from tests.zcore.zero.common import config, full_params, make_model, train


def offload_vs_plain(
    rank: int,
    world: int,
    stage: int,
    offload: dict[str, Any],
    ckpt: str,
    steps: int,
    zero: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """``zero``: more ``zero_optimization`` keys of the offloaded engine; ``extra``: more
    top-level config keys of both (an optimizer, say)."""
    plain, *_ = zcore.initialize(make_model(), config=config(stage, **extra))
    plain_losses = train(plain, steps)
    plain_params = full_params(plain)
    plain.destroy()

    cfg = config(stage, zero_optimization={"offload_optimizer": offload, **(zero or {})}, **extra)
    half = steps // 2
    first, *_ = zcore.initialize(make_model(), config=cfg)
    losses = train(first, half)
    first.save_checkpoint(ckpt)
    first.destroy()
    del first
    second, *_ = zcore.initialize(make_model(seed=7), config=cfg)  # other init: load must win
    second.load_checkpoint(ckpt)
    losses += train(second, steps - half, start=half)
    params = full_params(second)
    kind = type(second.zopt.store).__name__
    second.destroy()
    return {
        "plain_losses": plain_losses,
        "plain_params": plain_params,
        "losses": losses,
        "params": params,
        "zopt": kind,
    }


def assert_matches(got: dict[str, Any], atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(got["plain_losses"]), atol=atol, rtol=0
    )
    for name, value in got["plain_params"].items():
        torch.testing.assert_close(got["params"][name], value, atol=atol, rtol=0, msg=name)

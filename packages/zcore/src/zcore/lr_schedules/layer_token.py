"""The LayerToken learning-rate schedule of random-LTD: the rate follows layer-tokens
consumed, not steps.

With random-LTD a step early in training costs fewer layer-tokens (middle layers see a
fraction of the tokens) than one late in it, so a step-based warm-up and decay would move
faster than the compute actually spent. The random-LTD paper (Yao et al., 2022) drives the
learning rate by layer-tokens instead; DeepSpeed names its keys
(``layer_token_lr_schedule{ total_layer_tokens, warmup_type, warmup_layer_tokens }``) and
raises NotImplementedError for it. zcore's definition, with ``c`` the layer-tokens consumed
before the step, ``W`` = ``warmup_layer_tokens``, ``N`` = ``total_layer_tokens`` and
``peak`` each param group's lr from the optimizer:

- warm-up, ``c < W``: ``linear``: ``peak * c / W``; ``log``: ``peak * log(1 + c) / log(1 + W)``;
- then cosine decay to 0: ``peak * 0.5 * (1 + cos(pi * min(1, (c - W) / (N - W))))``.

``layer_tokens(steps_done)`` gives ``c`` (random-LTD's
:meth:`~zcore.data_efficiency.random_ltd_schedule.RandomLTDScheduler.layer_tokens_before`),
so the rate is a closed-form function of the iteration, on DeepSpeed's step convention like
every zcore schedule (see :mod:`zcore.lr_schedules`): optimizer step ``k`` (1-based) runs at
``c`` = the layer-tokens of the ``k - 1`` steps before it, and a resume needs only
``last_batch_iteration``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch.optim import Optimizer

from zcore.lr_schedules._base import _check_int, _IterationSchedule, _prepare_resume, _unwrap


def layer_token_factor(consumed: int, total: int, warmup: int, warmup_type: str) -> float:
    """The fraction of the peak rate after ``consumed`` layer-tokens (module docstring)."""
    if consumed < warmup:
        if warmup_type == "log":
            return math.log(1 + consumed) / math.log(1 + warmup)
        return consumed / warmup
    progress = min(1.0, (consumed - warmup) / (total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class LayerTokenLR(_IterationSchedule):
    """Warm-up then cosine decay over layer-tokens (see the module docstring)."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_layer_tokens: int,
        layer_tokens: Callable[[int], int],
        warmup_layer_tokens: int = 0,
        warmup_type: str = "linear",
        last_batch_iteration: int = -1,
    ) -> None:
        optimizer = _unwrap(optimizer)
        self.total_layer_tokens = _check_int(total_layer_tokens, "total_layer_tokens", 1)
        self.warmup_layer_tokens = _check_int(warmup_layer_tokens, "warmup_layer_tokens", 0)
        if self.warmup_layer_tokens >= self.total_layer_tokens:
            raise ValueError(
                f"warmup_layer_tokens {warmup_layer_tokens} must be below total_layer_tokens "
                f"{total_layer_tokens}"
            )
        if warmup_type not in ("linear", "log"):
            raise ValueError(f"warmup_type must be 'linear' or 'log', got {warmup_type!r}")
        self.warmup_type = warmup_type
        self.layer_tokens = layer_tokens
        # a step schedule built on this optimizer before (the engine's) moved lr off its peak
        self.peaks = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        _prepare_resume(optimizer, last_batch_iteration)
        super().__init__(optimizer, last_batch_iteration)

    def _lrs_at(self, iteration: int) -> list[float]:
        consumed = self.layer_tokens(iteration + 1)  # the steps done before the next one
        factor = layer_token_factor(
            consumed, self.total_layer_tokens, self.warmup_layer_tokens, self.warmup_type
        )
        return [peak * factor for peak in self.peaks]

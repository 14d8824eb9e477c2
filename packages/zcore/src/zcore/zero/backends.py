"""Where a rank's optimizer partition lives, by ``offload_optimizer.device``.

zcore keeps it in memory on the model's device (``"none"``). Packages that build offload
register a factory for their device name at import (zoffload: ``"cpu"`` and ``"nvme"``);
zcore finds installed ones through the ``zcore.extensions`` entry points, so a config
naming the device is enough, as with DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zcore.config.features import load_extensions
from zcore.zero.optimizer import ZeroOptimizer

#: ``factory(config, *args, **kwargs)`` → a :class:`ZeroOptimizer`: ``config`` is the
#: engine's :class:`~zcore.config.ZConfig`, the other arguments :class:`ZeroOptimizer`'s.
OptimizerBackend = Callable[..., ZeroOptimizer]

_BACKENDS: dict[str, OptimizerBackend] = {}

#: ``factory(config, stage3)`` → the :class:`~zcore.zero.stage3.ShardStore` that takes over
#: the stage-3 shards for ``offload_param.device``.
ParamBackend = Callable[..., Any]

_PARAM_BACKENDS: dict[str, ParamBackend] = {}


def register_param_backend(device: str, factory: ParamBackend) -> None:
    """Make ``offload_param.device = device`` keep stage-3 shards in ``factory``'s store."""
    _PARAM_BACKENDS[device] = factory


def param_backend(device: str) -> ParamBackend:
    """The store factory for ``offload_param.device`` (not ``"none"``)."""
    if device not in _PARAM_BACKENDS:
        load_extensions()
    try:
        return _PARAM_BACKENDS[device]
    except KeyError:
        raise ValueError(
            f'zero_optimization.offload_param.device = "{device}" is built by the zoffload '
            'package, which is not installed: `pip install zoffload`, or set device to "none"'
        ) from None


def register_optimizer_backend(device: str, factory: OptimizerBackend) -> None:
    """Make ``offload_optimizer.device = device`` build its optimizer with ``factory``."""
    _BACKENDS[device] = factory


def optimizer_backend(device: str) -> OptimizerBackend:
    """The factory for ``device``; ``"none"`` is zcore's in-memory :class:`ZeroOptimizer`."""
    if device == "none":
        return _in_memory
    if device not in _BACKENDS:
        load_extensions()
    try:
        return _BACKENDS[device]
    except KeyError:
        raise ValueError(
            f'zero_optimization.offload_optimizer.device = "{device}" is built by the zoffload '
            'package, which is not installed: `pip install zoffload`, or set device to "none"'
        ) from None


def _in_memory(config: Any, *args: Any, **kwargs: Any) -> ZeroOptimizer:
    return ZeroOptimizer(*args, **kwargs)

"""Where a rank's optimizer partition lives, by ``offload_optimizer.device``.

Each device names an :class:`~zcore.zero.store.OptimizerStore` factory. zcore keeps the
partition in memory on the model's device (``"none"``). Packages that build offload
register a factory for their device name at import (zoffload: ``"cpu"`` and ``"nvme"``);
zcore finds installed ones through the ``zcore.extensions`` entry points, so a config
naming the device is enough, as with DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zcore.config.features import load_extensions
from zcore.zero.store import MemoryStore, OptimizerStore

#: ``factory(config)`` → the :class:`~zcore.zero.store.OptimizerStore` that keeps a rank's
#: master weights, optimizer state and gradient partitions for ``offload_optimizer.device``.
OptimizerBackend = Callable[[Any], OptimizerStore]

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
    """Make ``offload_optimizer.device = device`` keep the optimizer partition in the store
    ``factory(config)`` builds."""
    _BACKENDS[device] = factory


def optimizer_backend(device: str) -> OptimizerBackend:
    """The store factory for ``device``; ``"none"`` is zcore's :class:`MemoryStore`."""
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


def _in_memory(config: Any) -> OptimizerStore:
    return MemoryStore()

"""Layer specifications: a layer described by its class and arguments, built only where used.

``LayerSpec(cls, *args, **kwargs)`` is DeepSpeed's: a :class:`~zcore.pipe.PipelineModule`
builds it on the rank whose stage holds it, and on the ``meta`` device elsewhere (to count
its parameters and infer the activation shapes between stages without allocating memory).
``TiedLayerSpec(key, cls, ...)`` names a layer shared by every stage that uses ``key``
(a tied embedding and output head): each of those stages holds one copy, the copies start
equal and their gradients are summed across the tie before every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class LayerSpec:
    """A layer to build later: ``typename(*module_args, **module_kwargs)``."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(
                f"LayerSpec needs an nn.Module subclass, got {typename!r}; pass the class, "
                "not an instance"
            )
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        """The layer, on the current default device."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def build_meta(self) -> nn.Module:
        """The layer on the ``meta`` device: shapes and counts, no memory."""
        with torch.device("meta"):
            return self.build()

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer shared by key: every stage using ``key`` holds the same module's weights.

    ``forward_fn(module, x)``, when given, is how this use of the module runs (an output
    head reading the embedding's weight); ``tied_weight_attr`` names the tied parameter(s).
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | list[str] = "weight",
        **module_kwargs: Any,
    ):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (
            [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        )

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"

"""Deprecated: moved to :mod:`zcore.optim.factory` (this name sat beside the ``zcore.optim``
package and read like part of it). Importing it still works, with a DeprecationWarning."""

from __future__ import annotations

import warnings

from zcore.optim.factory import Factory, build_inner_optimizer

warnings.warn(
    "zcore.optim_factory moved to zcore.optim.factory; import build_inner_optimizer from there",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["Factory", "build_inner_optimizer"]

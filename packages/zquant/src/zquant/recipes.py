"""Deprecated: this module is `zquant.schemes` now (`zstack.recipes` are training scripts).

Every name still imports from here, with a `DeprecationWarning`; import it from
`zquant.schemes` (or `zquant` itself: `zquant.Recipe`, `zquant.get_recipe`) instead.
"""

from __future__ import annotations

import warnings
from typing import Any

import zquant.schemes as _schemes

__all__ = list(_schemes.__all__)


def __getattr__(name: str) -> Any:
    if name.startswith("__") or not hasattr(_schemes, name):
        raise AttributeError(f"module 'zquant.recipes' has no attribute {name!r}")
    warnings.warn(
        f"`zquant.recipes` is deprecated: import `{name}` from `zquant.schemes`",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_schemes, name)


def __dir__() -> list[str]:
    return sorted(__all__)

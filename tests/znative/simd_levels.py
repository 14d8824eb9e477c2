"""The SIMD levels this CPU can run, lowest first (the tests force each in turn)."""

from __future__ import annotations

import znative

_ORDER = ("scalar", "avx2", "avx512")
LEVELS = _ORDER[: _ORDER.index(znative.detected_simd_level()) + 1]
